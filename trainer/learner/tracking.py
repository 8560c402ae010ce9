"""Optional experiment tracking: a training run mirrored to MLflow or Weights & Biases.

The ``training_runs`` row stays the record of a run; a tracker copies it to the team's experiment tool, where
runs of many policies and machines can be compared. Neither tool is a Kaizen dependency (the ``tracking`` extra
installs both): the import happens only when a policy's ``train.tracking`` names one. Where the data goes is
left to each tool's own environment variables (``MLFLOW_TRACKING_URI``; ``WANDB_API_KEY``, ``WANDB_MODE``,
``WANDB_DIR``, ``WANDB_ENTITY``), so Kaizen holds no tracking credentials. Tracking never fails a run: a
missing package, an unreachable server or a rejected value is logged as a warning and the run goes on.
"""

from __future__ import annotations

import json
import logging
import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from trainer.control.policy_config import TrainConfig

logger = logging.getLogger(__name__)

#: MLflow's limits per `log_batch` call.
_MLFLOW_MAX_PARAMS = 100
_MLFLOW_MAX_METRICS = 1000
_MAX_ERROR_CHARS = 1000


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a ``training_runs.metrics`` dict, nested dicts as ``data/<counter>``.

    Lists are left out: the collapse history is logged as a series over steps instead (`collapse_series`).
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            out.update(flatten_metrics(value, f"{prefix}{key}/"))
        elif isinstance(value, int | float):  # bool too: `stopped_early` becomes 0/1
            out[f"{prefix}{key}"] = float(value)
    return out


def collapse_series(history: Sequence[Mapping[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """The collapse checks of a run (``metrics["collapse"]``) as ``(optimizer step, signals)``, in step order."""
    return [
        (
            int(entry["step"]),
            {
                f"collapse/{name}": float(value)
                for name, value in entry.items()
                if name != "step" and isinstance(value, int | float)
            },
        )
        for entry in history
    ]


def _param_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Tracker:
    """One training run's mirror; this base tracks nothing (``tracking: none``, or a backend that failed)."""

    def finish(
        self,
        status: str,
        metrics: Mapping[str, Any],
        *,
        version: int | None = None,
        error: str | None = None,
    ) -> None:
        """Log the run's outcome (`metrics` as stored on ``training_runs``) and close the run."""


class _BackendTracker(Tracker):
    backend: str

    def finish(
        self,
        status: str,
        metrics: Mapping[str, Any],
        *,
        version: int | None = None,
        error: str | None = None,
    ) -> None:
        """Never raises: the run has already succeeded or failed on its own, whatever the backend says."""
        try:
            self._finish(status, metrics, version, error)
        except Exception as exc:
            logger.warning(
                "%s: could not log the training run's outcome (%s); the run itself is unaffected",
                self.backend,
                exc,
            )

    @abstractmethod
    def _finish(
        self, status: str, metrics: Mapping[str, Any], version: int | None, error: str | None
    ) -> None: ...


class MlflowTracker(_BackendTracker):
    """A run in the MLflow experiment `project`, through `MlflowClient` (no fluent API state, so it is safe to
    call from any thread and next to a caller's own active MLflow run)."""

    backend = "mlflow"

    def __init__(self, project: str, run_name: str, params: Mapping[str, Any], run: Mapping[str, Any]):
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        # MLFLOW_TRACKING_URI; unset: MLflow's default, sqlite:///mlflow.db in the working directory.
        self._client = MlflowClient()
        experiment = self._client.get_experiment_by_name(project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self._client.create_experiment(project)
            except MlflowException:  # created meanwhile by a run of another policy sharing the project
                existing = self._client.get_experiment_by_name(project)
                if existing is None:
                    raise
                experiment_id = existing.experiment_id
        tags = {f"kaizen.{key}": str(value) for key, value in run.items() if value is not None}
        self._run_id: str = self._client.create_run(experiment_id, tags=tags, run_name=run_name).info.run_id
        items = [Param(key, _param_value(value)) for key, value in params.items()]
        for chunk in _chunks(items, _MLFLOW_MAX_PARAMS):
            self._client.log_batch(self._run_id, params=list(chunk))

    def _finish(
        self, status: str, metrics: Mapping[str, Any], version: int | None, error: str | None
    ) -> None:
        from mlflow.entities import Metric, RunTag

        try:
            now = int(time.time() * 1000)
            final = flatten_metrics(metrics)
            step = int(final.get("steps", 0))
            rows = [
                Metric(key, value, now, at)
                for at, signals in collapse_series(metrics.get("collapse") or [])
                for key, value in signals.items()
            ]
            rows += [Metric(key, value, now, step) for key, value in final.items()]
            for chunk in _chunks(rows, _MLFLOW_MAX_METRICS):
                self._client.log_batch(self._run_id, metrics=list(chunk))
            tags = {"kaizen.status": status}
            if version is not None:
                tags["kaizen.version"] = str(version)
            if error:
                tags["kaizen.error"] = error[:_MAX_ERROR_CHARS]
            self._client.log_batch(self._run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        finally:
            self._client.set_terminated(self._run_id, "FAILED" if status == "failed" else "FINISHED")


class WandbTracker(_BackendTracker):
    """A W&B run in `project`; ``WANDB_MODE=offline`` writes it under ``WANDB_DIR`` for a later `wandb sync`."""

    backend = "wandb"

    def __init__(self, project: str, run_name: str, params: Mapping[str, Any], run: Mapping[str, Any]):
        import wandb

        self._run = wandb.init(
            project=project,
            name=run_name,
            group=run["policy"],
            job_type="train",
            config={**params, "kaizen": dict(run)},
            tags=[f"policy:{run['policy']}"],
            # Several runs may live in one process (tests, a notebook): never finish someone else's run.
            reinit="create_new",
            # Console capture would rewrite the trainer's stdout/stderr; the log already has the steps.
            settings=wandb.Settings(console="off", save_code=False),
        )

    def _finish(
        self, status: str, metrics: Mapping[str, Any], version: int | None, error: str | None
    ) -> None:
        try:
            for step, signals in collapse_series(metrics.get("collapse") or []):
                self._run.log(signals, step=step)
            summary: dict[str, Any] = {**flatten_metrics(metrics), "kaizen/status": status}
            if version is not None:
                summary["kaizen/version"] = version
            if error:
                summary["kaizen/error"] = error[:_MAX_ERROR_CHARS]
            self._run.summary.update(summary)
        finally:
            self._run.finish(exit_code=1 if status == "failed" else 0)


_BACKENDS: dict[str, type[MlflowTracker] | type[WandbTracker]] = {
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}
_PACKAGES = {"mlflow": "mlflow-skinny", "wandb": "wandb"}


def open_tracker(cfg: TrainConfig, *, policy: str, run_id: int, from_version: int | None) -> Tracker:
    """Start mirroring a run, with its configuration as parameters; the base `Tracker` when none is wanted or
    the backend cannot start (missing package, unreachable server: logged, and the run goes on)."""
    if cfg.tracking == "none":
        return Tracker()
    project = cfg.tracking_project or f"kaizen-{policy}"
    run = {"policy": policy, "run_id": run_id, "from_version": from_version}
    try:
        tracker = _BACKENDS[cfg.tracking](project, f"{policy}-run-{run_id}", cfg.model_dump(mode="json"), run)
    except ImportError as exc:
        logger.warning(
            "tracking = %r but %s cannot be imported (%s); install it (pip install 'kaizen[tracking]'). "
            "Training run %d goes on untracked.",
            cfg.tracking,
            _PACKAGES[cfg.tracking],
            exc,
            run_id,
        )
        return Tracker()
    except Exception as exc:
        logger.warning(
            "tracking = %r could not start a run in %r (%s); training run %d goes on untracked",
            cfg.tracking,
            project,
            exc,
            run_id,
        )
        return Tracker()
    logger.info("training run %d is tracked in %s project %r", run_id, cfg.tracking, project)
    return tracker
