"""Training on several processes through PyTorch's engines (torchrun, FSDP or DDP, gloo on CPUs) takes the same
step as one process: the LoRA gradients of one optimizer step, computed by two processes that split its
micro-batches, match those of one process computing them all. The model is small (the embedded model's tokenizer
on two random layers): these tests are about processes, signals and sums, not about what a step learns."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from storage.database import Database
from storage.jobs import list_runs
from storage.policies import get_policy, list_adapters
from tests.conftest import SMALL_MODEL_LAYERS
from tests.integration.test_train_command import PARENT_DIED, POLICY, TRAIN, setup_policy
from tests.support.sql import fetch_rows
from tests.support.stopping import Stopped, stop_mid_run

# Kills and restarts whole process trees: `make test-fast` leaves it out (README, "Test").
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# Two float32 sums of the same terms in another order: equal to a few parts in 10⁷. A step that counted one
# process's share twice, or halved it (the engine averages), is off by a factor of two.
RELATIVE_TOLERANCE = 1e-5
#: Two groups, so that each of two processes has one.
PROMPTS = ("Say hi.", "Say yes.")


def step_gradients(model: Path, out: Path, processes: int, sharding: str) -> dict[str, torch.Tensor]:
    command = [
        sys.executable,
        "-m",
        "tests.support.distributed_step",
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    if processes > 1:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
            "-m", "tests.support.distributed_step", "--model", str(model), "--out", str(out), "--sharding", sharding,
        ]  # fmt: skip
    # One thread each, as torchrun gives its processes: threads split a matrix product's sums differently.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    grads: dict[str, torch.Tensor] = torch.load(out)
    return grads


@pytest.fixture(scope="module")
def alone(small_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The step's gradients computed by one process."""
    return step_gradients(small_model, tmp_path_factory.mktemp("alone") / "one.pt", 1, "fsdp")


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_two_processes_take_the_step_one_process_takes(
    sharding: str, alone: dict[str, torch.Tensor], small_model: Path, tmp_path: Path
) -> None:
    together = step_gradients(small_model, tmp_path / "two.pt", 2, sharding)
    assert set(together) == set(alone)
    every_layer = {str(i) for i in range(SMALL_MODEL_LAYERS)}
    assert {name.split(".layers.")[1].split(".")[0] for name in alone} == every_layer
    assert all(g.abs().max() > 0 for g in alone.values())
    for name, expected in alone.items():
        scale = float(expected.abs().max())
        difference = float((together[name] - expected).abs().max())
        assert difference <= RELATIVE_TOLERANCE * scale, (name, difference, scale)


def test_kaizen_train_on_two_processes_writes_a_candidate(tmp_path: Path, small_model: Path) -> None:
    """The whole run through `kaizen train` with KAIZEN_TRAIN_PROCESSES=2: torchrun starts two trainers, rank 0
    reads the data and hands the samples over, both take the step, rank 0 writes the adapter and the rows. A
    second run finds nothing new and exits as on one process (3, skipped), without a traceback."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"

    async def outcome() -> tuple[list[tuple[int, str, str]], list[str]]:
        database = Database(url)
        try:
            async with database.session() as session:
                policy = await get_policy(session, POLICY)
                assert policy is not None
                adapters = [(a.version, a.status, a.path) for a in await list_adapters(session, policy.id)]
                runs = [r.status for r in await list_runs(session, POLICY)]
        finally:
            await database.dispose()
        return adapters, runs

    asyncio.run(setup_policy(url, small_model, {"train": TRAIN}, PROMPTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}

    def kaizen_train() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway", "train", "--policy", POLICY, "--device", "cpu"],
            env={
                **env,
                "KAIZEN_DATABASE_URL": url,
                "KAIZEN_DATA_DIR": str(tmp_path / "data"),
                "KAIZEN_TRAIN_PROCESSES": "2",
                "KAIZEN_TRAIN_SAMPLER": "local",
            },
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )

    trained = kaizen_train()
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-4000:]
    assert "training process 1 of 2" in trained.stderr  # the follower took part
    [(_, status, path)] = asyncio.run(outcome())[0]
    assert status == "candidate" and (Path(path) / "adapter_model.safetensors").is_file()
    assert asyncio.run(outcome())[1] == ["succeeded"]

    again = kaizen_train()
    assert again.returncode == 3, again.stdout[-3000:] + again.stderr[-4000:]
    assert "Traceback" not in again.stderr, again.stderr[-4000:]
    assert asyncio.run(outcome())[1] == ["skipped", "succeeded"]


def stop_two_process_run(
    tmp_path: Path, base_model: Path, signum: signal.Signals, victim: str | None = None
) -> tuple[Stopped, str]:
    """`kaizen train` of a long run on two processes, sent `signum` at its first step (`victim`: see
    `stop_mid_run`): how it ended, and the database's URL."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"
    asyncio.run(setup_policy(url, base_model, {"train": {**TRAIN, "epochs": 10_000}}, PROMPTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAIZEN_")}
    stopped = stop_mid_run(
        [sys.executable, "-m", "gateway", "train", "--policy", POLICY, "--device", "cpu"],
        {
            **env,
            "KAIZEN_DATABASE_URL": url,
            "KAIZEN_DATA_DIR": str(tmp_path / "data"),
            "KAIZEN_TRAIN_PROCESSES": "2",
            "KAIZEN_TRAIN_SAMPLER": "local",
        },
        signum,
        tmp_path / "train.log",
        start_timeout_s=400,
        victim=victim,
    )
    return stopped, url


def test_kaizen_train_on_two_processes_stopped_by_sigterm_records_the_run_failed(
    tmp_path: Path, small_model: Path
) -> None:
    """SIGTERM to `kaizen train` alone (a container's main process, as Kubernetes stops it) is passed on to
    torchrun, which stops both trainers: rank 0 records the run failed and frees the policy, none is left, and
    every process ends in a log line rather than a traceback."""
    stopped, url = stop_two_process_run(tmp_path, small_model, signal.SIGTERM)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.output[-4000:]
    assert stopped.output.count("training stopped by SIGTERM") == 2, stopped.output[-4000:]  # both ranks
    assert "torchrun stopped by SIGTERM" in stopped.output, stopped.output[-4000:]
    assert "Traceback" not in stopped.output, stopped.output[-4000:]
    [run] = asyncio.run(fetch_rows(url, "SELECT status, error FROM training_runs WHERE kind = 'train'"))
    assert (run["status"], run["error"]) == ("failed", "interrupted"), stopped.output[-4000:]
    assert asyncio.run(fetch_rows(url, "SELECT key FROM job_locks")) == []


def test_a_sigkilled_kaizen_train_on_two_processes_frees_the_policy(
    tmp_path: Path, small_model: Path
) -> None:
    """SIGKILL to `kaizen train` alone, which holds the policy's lock its trainers run under: torchrun gets its
    parent-death signal and hands it to both trainers, so rank 0 records that the process that started the run
    died and releases the lock its dead parent cannot, and no process is left."""
    stopped, url = stop_two_process_run(tmp_path, small_model, signal.SIGKILL)
    assert stopped.returncode == -signal.SIGKILL, stopped.output[-4000:]
    [run] = asyncio.run(fetch_rows(url, "SELECT status, error FROM training_runs WHERE kind = 'train'"))
    assert (run["status"], run["error"]) == ("failed", PARENT_DIED), stopped.output[-4000:]
    assert asyncio.run(fetch_rows(url, "SELECT key FROM job_locks")) == []


def test_a_killed_torchrun_takes_its_trainers_with_it(tmp_path: Path, small_model: Path) -> None:
    """SIGKILL to torchrun alone: the OOM killer's pick, or the end of a stop that took too long (the scheduler
    then kills the child's process group). torchrun starts each trainer in a session of its own, so neither
    reaches them; each asked Linux for a SIGKILL when torchrun dies, instead of training on (or waiting in a
    collective for hours) with nothing left to stop it. `kaizen train` records the run that rank 0 could not
    and frees the policy at once."""
    stopped, url = stop_two_process_run(tmp_path, small_model, signal.SIGKILL, "trainer.learner.torchrun")
    # No trainer is left (stop_mid_run fails the test otherwise); `kaizen train` says what became of its child.
    assert stopped.returncode == 128 + signal.SIGKILL, stopped.output[-4000:]
    assert "the training process was killed by SIGKILL" in stopped.output, stopped.output[-4000:]
    [run] = asyncio.run(fetch_rows(url, "SELECT status, error FROM training_runs WHERE kind = 'train'"))
    assert (run["status"], run["error"]) == ("failed", "training process killed by SIGKILL")
    assert asyncio.run(fetch_rows(url, "SELECT key FROM job_locks")) == []
