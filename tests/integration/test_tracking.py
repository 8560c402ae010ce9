"""Experiment tracking of real training runs: MLflow (a local SQLite store) and W&B (offline run files), read back
with each tool's own reader; a configured backend that is missing or unreachable never fails the run.

Each run trains a small random-weight model with the embedded model's tokenizer for a few tiny steps on text-only
captured calls (re-tokenised), with a collapse check after every step, so the tracked metrics include a per-step
series.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from migrations.runner import upgrade_database
from storage.database import Database
from storage.policies import create_policy
from tests.support.training_data import NO_COLLAPSE_BOUNDS, RewardedReply, write_rewarded_groups
from tests.support.wandb_offline import read_offline_run
from trainer.learner.job import TrainOutcome, TrainRequest, run_training

POLICY = "tracked"
#: Two prompts with three replies each with different rewards: two groups, six samples, three optimizer steps.
REPLIES = {
    "Say hi.": [("hi", 1.0), ("hello there", 0.5), ("", 0.0)],
    "Say bye.": [("bye", 1.0), ("ok", 0.2), ("no", 0.0)],
}
TRAIN = {
    "grouping": "key",
    "group_size": 3,
    "epochs": 1,
    "micro_batch_size": 2,
    "grad_accumulation": 1,
    "max_length": 64,
    "collapse_check_every": 1,
    "collapse_prompts": 1,
    "collapse_samples": 2,
    "collapse_max_new_tokens": 4,
    # Four-token replies of an untrained LoRA are no collapse; this test is about what gets logged.
    "collapse_bounds": NO_COLLAPSE_BOUNDS,
}


async def _insert_data(db: Database) -> None:
    groups = [
        (prompt, [RewardedReply(text, reward) for text, reward in replies])
        for prompt, replies in REPLIES.items()
    ]
    await write_rewarded_groups(db, POLICY, groups, "fixed")


def train(tmp_path: Path, model: Path, **train: Any) -> TrainOutcome:
    """One real `run_training` of a fresh policy with `train` added to the test's TrainConfig."""
    tmp_path.mkdir(exist_ok=True)
    url = f"sqlite+aiosqlite:///{tmp_path / 'kaizen.db'}"

    async def scenario() -> TrainOutcome:
        await upgrade_database(url)
        db = Database(url)
        try:
            config = {"train": {**TRAIN, **train}, "gate": {"holdout_fraction": 0.0}}
            async with db.session() as session:
                await create_policy(session, POLICY, "smollm2-135m-instruct", config)
                await session.commit()
            await _insert_data(db)
            return await run_training(db, TrainRequest(POLICY, tmp_path / "data", str(model), device="cpu"))
        finally:
            await db.dispose()

    return asyncio.run(scenario())


def test_mlflow_run_has_config_metrics_steps_and_tags(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    outcome = train(tmp_path, small_model, tracking="mlflow", learning_rate=1e-4)
    assert outcome.status == "succeeded", outcome.error

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(f"kaizen-{POLICY}")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == f"{POLICY}-run-{outcome.run_id}"
    tags = run.data.tags
    assert tags["kaizen.policy"] == POLICY
    assert tags["kaizen.run_id"] == str(outcome.run_id)
    assert tags["kaizen.version"] == str(outcome.version)
    assert tags["kaizen.status"] == "succeeded"
    assert "kaizen.from_version" not in tags  # the policy had no version yet

    params = run.data.params
    assert params["learning_rate"] == "0.0001"
    assert params["grouping"] == "key"
    assert params["tracking"] == "mlflow"
    assert params["target_modules"].startswith('["q_proj"')

    metrics = outcome.metrics
    logged = run.data.metrics
    for name in ("groups", "trajectories", "samples", "tokens", "loss", "reward_mean", "reward_std"):
        assert logged[name] == pytest.approx(float(metrics[name])), name
    for name in ("clip_fraction", "mean_ratio", "tokens_per_s", "wall_s"):
        assert logged[name] == pytest.approx(metrics[name]), name
    assert logged["groups"] == 2 and logged["samples"] == 6
    assert logged["data/retokenised"] == metrics["data"]["retokenised"] > 0

    history = client.get_metric_history(run.info.run_id, "collapse/distinct_share")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == [0, 1, 2, 3]
    assert [c["step"] for c in metrics["collapse"]] == [0, 1, 2, 3]
    assert sorted(history, key=lambda m: m.step)[-1].value == pytest.approx(
        metrics["collapse"][-1]["distinct_share"]
    )


def test_wandb_offline_run_files_hold_config_and_summary(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, folder in [
        ("WANDB_DIR", "wandb"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
    ]:
        (tmp_path / folder).mkdir()
        monkeypatch.setenv(name, str(tmp_path / folder))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    outcome = train(tmp_path, small_model, tracking="wandb", tracking_project="kaizen-tests")
    assert outcome.status == "succeeded", outcome.error

    [run_dir] = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    run = read_offline_run(run_dir)
    assert run.project == "kaizen-tests"
    assert run.name == f"{POLICY}-run-{outcome.run_id}"
    assert run.group == POLICY
    assert run.config["grouping"] == "key"
    assert run.config["kaizen"] == {"policy": POLICY, "run_id": outcome.run_id, "from_version": None}
    metrics = outcome.metrics
    assert run.summary["kaizen/version"] == outcome.version
    assert run.summary["kaizen/status"] == "succeeded"
    for name in ("groups", "samples", "tokens", "loss", "reward_mean", "clip_fraction", "tokens_per_s"):
        assert run.summary[name] == pytest.approx(float(metrics[name])), name
    assert run.summary["data/retokenised"] == metrics["data"]["retokenised"]
    assert [row["_step"] for row in run.history] == [0, 1, 2, 3]
    assert run.history[-1]["collapse/distinct_share"] == pytest.approx(
        metrics["collapse"][-1]["distinct_share"]
    )
    assert run.exit_code == 0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_or_missing_backend_never_fails_a_run(
    tmp_path: Path, small_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trainer.learner.tracking")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    outcome = train(tmp_path / "unreachable", small_model, tracking="mlflow")
    assert outcome.status == "succeeded", outcome.error
    assert "could not start a run in 'kaizen-tracked'" in caplog.text

    caplog.clear()
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without the package imports
    outcome = train(tmp_path / "missing", small_model, tracking="wandb")
    assert outcome.status == "succeeded", outcome.error
    assert "tracking = 'wandb' but wandb cannot be imported" in caplog.text
