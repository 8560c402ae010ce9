"""The trainer's entry point, as the scheduler and an operator run it: `python -m trainer.learner` in its own
process with its `TrainingJob` on stdin, and `kaizen train`, which starts the same child with the job it builds
from the gateway's settings."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gateway.commands import train as train_command
from migrations.runner import upgrade_database
from storage.database import Database
from storage.locks import acquire_lock
from storage.policies import PolicyInfo, create_policy, get_policy, list_adapters
from tests.support.ports import free_port
from tests.support.sql import fetch_rows
from tests.support.stopping import stop_mid_run
from tests.support.training_data import NO_COLLAPSE_BOUNDS, RewardedReply, write_rewarded_groups
from trainer.control.ruler import JudgeSettings
from trainer.control.run_logs import run_log_path
from trainer.control.training_job import BAD_JOB, NO_CANDIDATE, TrainingJob, exit_error

REPO = Path(__file__).resolve().parents[2]
POLICY = "by-hand"
#: What a run records when its training child got its parent-death signal.
PARENT_DIED = "interrupted: the process that started it died (SIGHUP)"
TRAIN = {
    "grouping": "key",
    "group_size": 3,
    "epochs": 1,
    "micro_batch_size": 3,
    "grad_accumulation": 1,
    "max_length": 64,
    "collapse_check_every": 0,
    "collapse_prompts": 1,
    "collapse_samples": 2,
    "collapse_max_new_tokens": 4,
    "collapse_bounds": NO_COLLAPSE_BOUNDS,
}


def _env() -> dict[str, str]:
    """This process's environment without any KAIZEN_* setting: the child gets only what the test passes."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}


def job(url: str, data_dir: Path, base_model: Path) -> bytes:
    """The job line the scheduler would hand the child: resampling with the trainer's own model, on the CPU."""
    return TrainingJob(
        policy=POLICY,
        database_url=url,
        data_dir=str(data_dir),
        base_model=str(base_model),
        judge=JudgeSettings(model=""),
        device="cpu",
    ).encode()


async def setup_policy(
    url: str, base_model: Path, config: dict[str, Any], prompts: Sequence[str] = ("Say hi.",)
) -> None:
    """A policy with one rewarded group of three replies to each prompt."""
    await upgrade_database(url)
    database = Database(url)
    try:
        async with database.session() as session:
            await create_policy(session, POLICY, str(base_model), config)
            await session.commit()
        replies = [RewardedReply("hi", 1.0), RewardedReply("hello", 0.5), RewardedReply("", 0.0)]
        await write_rewarded_groups(database, POLICY, [(prompt, replies) for prompt in prompts], "fixed")
    finally:
        await database.dispose()


@pytest.mark.slow
def test_python_m_trainer_writes_a_candidate_and_kaizen_train_finds_nothing_new(
    tmp_path: Path, small_model: Path
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"
    asyncio.run(setup_policy(url, small_model, {"train": TRAIN, "gate": {"holdout_fraction": 0.0}}))
    trained = subprocess.run(
        [sys.executable, "-m", "trainer.learner"],
        input=job(url, tmp_path / "data", small_model),
        env=_env(),
        cwd=REPO,
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert trained.returncode == 0, trained.stderr.decode()[-4000:]

    async def adapters() -> list[tuple[int, str, str]]:
        database = Database(url)
        try:
            async with database.session() as session:
                policy = await get_policy(session, POLICY)
                assert policy is not None
                return [(a.version, a.status, a.path) for a in await list_adapters(session, policy.id)]
        finally:
            await database.dispose()

    [(version, status, path)] = asyncio.run(adapters())
    assert status == "candidate"
    assert Path(path).is_relative_to(tmp_path / "data") and (Path(path) / "adapter_config.json").is_file()

    # The same data again: `kaizen train` (settings from flags and the environment) runs, finds nothing new and
    # exits 3.
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "train",
            "--policy",
            POLICY,
            "--database-url",
            f"sqlite:///{tmp_path / 'kaizen.db'}",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        env={
            **_env(),
            "KAIZEN_TRAIN_SAMPLER": "local",
            "KAIZEN_TRAIN_GPUS": "7",
            "KAIZEN_TRAIN_THREADS": "1",
        },
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert again.returncode == 3, again.stderr[-4000:]
    assert "skipped" in again.stderr
    assert f"training {POLICY} with CUDA_VISIBLE_DEVICES=7 OMP_NUM_THREADS=1" in again.stderr  # its placement
    assert [v for v, _, _ in asyncio.run(adapters())] == [version]


def _long_run(tmp_path: Path, base_model: Path) -> tuple[str, Path, dict[str, str]]:
    """A policy whose training runs far longer than a test waits: (database URL, data directory, environment of
    the command that trains it)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"
    long_run = {**TRAIN, "epochs": 10_000}
    asyncio.run(setup_policy(url, base_model, {"train": long_run, "gate": {"holdout_fraction": 0.0}}))
    data = tmp_path / "data"
    env = {
        **_env(),
        "KAIZEN_DATABASE_URL": url,
        "KAIZEN_DATA_DIR": str(data),
        "KAIZEN_TRAIN_SAMPLER": "local",
    }
    return url, data, env


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "signum", "sigint_ignored", "error"),
    [
        (["-m", "gateway", "train"], signal.SIGTERM, False, "interrupted"),
        (["-m", "gateway", "train"], signal.SIGINT, False, "interrupted"),
        (["-m", "trainer.learner"], signal.SIGTERM, False, "interrupted"),
        (["-m", "trainer.learner"], signal.SIGTERM, True, "interrupted"),
        (["-m", "trainer.learner"], signal.SIGHUP, False, PARENT_DIED),
        (
            ["-m", "gateway", "worker", "--once", "train"],
            signal.SIGTERM,
            False,
            "interrupted: the scheduler shut down",
        ),
    ],
    ids=[
        "kaizen-train-sigterm",
        "kaizen-train-ctrl-c",
        "python-m-trainer-sigterm",
        "python-m-trainer-sigterm-in-the-background",
        "python-m-trainer-parent-death-signal",
        "kaizen-worker-once-sigterm",
    ],
)
def test_a_run_stopped_by_a_signal_is_recorded_failed_and_frees_the_policy(
    tmp_path: Path,
    small_model: Path,
    command: list[str],
    signum: signal.Signals,
    sigint_ignored: bool,
    error: str,
) -> None:
    """Kubernetes, torchrun and systemd stop a process with SIGTERM, a person with Ctrl-C: either way the run is
    recorded as failed (not left `running` for ever), the policy's job lock is released at once (not after its
    time-to-live), no trainer is left running, and the command exits with 128 + the signal's number and no
    traceback. SIGTERM works the same where SIGINT is ignored, and through `kaizen worker --once`, whose
    training runs in a child process."""
    url, data, env = _long_run(tmp_path, small_model)
    learner = command == ["-m", "trainer.learner"]
    flags = [] if learner else ["--policy", POLICY]
    stopped = stop_mid_run(
        [sys.executable, *command, *flags],
        env,
        signum,
        tmp_path / "command.log",
        # The worker's training child writes its steps to the policy's training log.
        steps_log=data / "logs" / f"train-{POLICY}.log" if "worker" in command else None,
        sigint_ignored=sigint_ignored,
        stdin=job(url, data, small_model) if learner else None,
    )
    assert stopped.returncode == 128 + signum, stopped.output[-4000:]
    assert "Traceback" not in stopped.output, stopped.output[-4000:]
    [run] = asyncio.run(fetch_rows(url, "SELECT status, error FROM training_runs WHERE kind = 'train'"))
    assert (run["status"], run["error"]) == ("failed", error)
    if "worker" in command:  # the run's own log has its lines, those of its start and of its steps
        [row] = asyncio.run(fetch_rows(url, "SELECT id FROM training_runs WHERE kind = 'train'"))
        own = run_log_path(data, int(row["id"])).read_text()
        assert "started" in own and "step 1/" in own, own[-4000:]
    assert asyncio.run(fetch_rows(url, "SELECT key FROM job_locks")) == []
    assert asyncio.run(fetch_rows(url, "SELECT version FROM adapters")) == []  # no candidate


@pytest.mark.slow
def test_a_repeated_sigterm_stops_a_run_once(tmp_path: Path, small_model: Path) -> None:
    """Linux sends a training child its parent-death signal once for each thread of the dying parent, and a
    supervisor may repeat its SIGTERM, so a child can get several at once. The first stops the run; the others must
    not cut short its recording (the run would stay `running` and the lock held until a later job finds it
    abandoned)."""
    url, data, env = _long_run(tmp_path, small_model)
    stopped = stop_mid_run(
        [sys.executable, "-m", "trainer.learner"],
        env,
        signal.SIGTERM,
        tmp_path / "command.log",
        stdin=job(url, data, small_model),
        times=3,
    )
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.output[-4000:]
    assert "Traceback" not in stopped.output, stopped.output[-4000:]
    [run] = asyncio.run(fetch_rows(url, "SELECT status, error FROM training_runs WHERE kind = 'train'"))
    assert (run["status"], run["error"]) == ("failed", "interrupted")
    assert asyncio.run(fetch_rows(url, "SELECT key FROM job_locks")) == []


@pytest.mark.slow
def test_a_run_whose_gateway_is_sigkilled_records_that_its_parent_died(
    tmp_path: Path, small_model: Path
) -> None:
    """A SIGKILL to the process whose scheduler started a training child (here `kaizen worker --once`, as a
    gateway's does) reaches the child as its parent-death signal, from Linux. The run is recorded failed as
    interrupted because that process died, not as if someone had stopped the run, and the child's lines about
    it, which its dead parent can no longer copy, reach the policy's log all the same; and it frees the policy's
    lock, which its dead parent can no longer release, at once."""
    url, data, env = _long_run(tmp_path, small_model)
    policy_log = data / "logs" / f"train-{POLICY}.log"
    stopped = stop_mid_run(
        [sys.executable, "-m", "gateway", "worker", "--once", "train", "--policy", POLICY],
        env,
        signal.SIGKILL,
        tmp_path / "command.log",
        steps_log=policy_log,
    )
    assert stopped.returncode == -signal.SIGKILL
    [run] = asyncio.run(fetch_rows(url, "SELECT id, status, error FROM training_runs WHERE kind = 'train'"))
    assert (run["status"], run["error"]) == ("failed", PARENT_DIED)
    lines = policy_log.read_text()
    assert f"training run {run['id']} failed: {PARENT_DIED}" in lines, lines[-4000:]
    assert "training stopped by SIGHUP" in lines, lines[-4000:]
    assert asyncio.run(fetch_rows(url, "SELECT key FROM job_locks")) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "returncode", "error"),
    [
        (None, -signal.SIGKILL, PARENT_DIED),
        ("trainer.learner", 128 + signal.SIGKILL, "training process killed by SIGKILL"),
    ],
    ids=["kaizen-train", "its-child"],
)
def test_a_sigkill_to_kaizen_train_or_its_child_records_the_run_and_frees_the_policy(
    tmp_path: Path, small_model: Path, victim: str | None, returncode: int, error: str
) -> None:
    """`kaizen train` runs the training in a child of a session of its own, which no terminal reaches, under the
    policy's lock it holds for it. When `kaizen train` is SIGKILLed (a CI job's time limit) the child must stop
    too, not train on where no Ctrl-C can reach it: its run says why, and it frees the lock its dead parent
    cannot. When the child is SIGKILLed (the out-of-memory killer's pick), it records nothing: `kaizen train`
    marks the run failed with what killed it and frees the policy at once, instead of leaving the run `running`
    and the policy locked for `lock_ttl_s`."""
    url, _, env = _long_run(tmp_path, small_model)
    stopped = stop_mid_run(
        [sys.executable, "-m", "gateway", "train", "--policy", POLICY],
        env,
        signal.SIGKILL,
        tmp_path / "command.log",
        victim=victim,
    )
    assert stopped.returncode == returncode, stopped.output[-4000:]
    assert "Traceback" not in stopped.output, stopped.output[-4000:]
    [run] = asyncio.run(fetch_rows(url, "SELECT status, error FROM training_runs WHERE kind = 'train'"))
    assert (run["status"], run["error"]) == ("failed", error)
    assert asyncio.run(fetch_rows(url, "SELECT key FROM job_locks")) == []


def test_kaizen_train_refuses_a_policy_another_job_holds(tmp_path: Path, small_model: Path) -> None:
    """A policy whose job lock another live job holds is refused before any training process starts: one clear
    line, exit status 3, no run recorded, and the other job's lock left as it was."""
    url, _, env = _long_run(tmp_path, small_model)

    async def lock_it() -> None:
        database = Database(url)
        try:
            async with database.session() as session:
                assert await acquire_lock(session, POLICY, "elsewhere:1:job", "judge", ttl_s=600)
        finally:
            await database.dispose()

    asyncio.run(lock_it())
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "train", "--policy", POLICY],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == NO_CANDIDATE, done.stderr[-4000:]
    assert f"another job of policy '{POLICY}' is running" in done.stderr, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert asyncio.run(fetch_rows(url, "SELECT id FROM training_runs")) == []
    assert asyncio.run(fetch_rows(url, "SELECT owner FROM job_locks")) == [{"owner": "elsewhere:1:job"}]


def test_kaizen_train_logs_rather_than_raises_when_it_cannot_record_its_child_s_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After its child, `kaizen train` records a run the child left `running` and frees the policy; a database it
    cannot reach then (a PostgreSQL server stopped meanwhile) is one log line, not a traceback over the child's
    own outcome."""
    unreachable = f"postgresql+asyncpg://kaizen:secret@127.0.0.1:{free_port()}/kaizen"
    policy = PolicyInfo(1, POLICY, "m", None, {}, datetime.now(UTC))
    asyncio.run(train_command._settle(unreachable, policy, "here:1:job", 60.0, -signal.SIGKILL))
    assert f"could not record the end of the training run of '{POLICY}'" in caplog.text


def test_a_training_child_s_exit_is_said_plainly() -> None:
    """What a run records when its training child ended without recording it: the signal by name."""
    assert exit_error(-signal.SIGKILL) == "training process killed by SIGKILL"
    assert exit_error(1, "Killed") == "training process exited with 1; its log ended:\nKilled"
    assert exit_error(None) == "training process exited with None"


@pytest.mark.parametrize(
    "stdin", [b"", b"{not json\n", b'{"policy": "p"}\n'], ids=["none", "malformed", "partial"]
)
def test_the_learner_refuses_a_missing_or_malformed_job(stdin: bytes) -> None:
    """No job, or one it cannot read, is a clear error line and exit 2 before anything is loaded."""
    done = subprocess.run(
        [sys.executable, "-m", "trainer.learner"],
        input=stdin,
        env=_env(),
        cwd=REPO,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == BAD_JOB, done.stderr.decode()[-4000:]
    assert b"no training job on stdin" in done.stderr
    assert b"Traceback" not in done.stderr
