"""`python -m trainer.learner.initial_adapter`: builds version 0 of a new policy, a fresh LoRA that changes
nothing yet (PEFT initialises its B matrices to zero).

The gateway starts it for `kaizen policy create` and `POST /admin/policies` (`gateway.policies`), so that the
base model is loaded in a process of its own and never in the serving one. It speaks the model-job protocol of
`trainer.control.model_jobs`: an `InitialAdapterJob` on stdin, its log on stderr, and exit status `DONE`,
`BASE_MODEL_UNAVAILABLE` (the loader's reason, one line, on stdout) or `FAILED`.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from pathlib import Path

from trainer.control.model_jobs import (
    BASE_MODEL_UNAVAILABLE,
    DONE,
    FAILED,
    InitialAdapterJob,
    clip,
    configure_child_logging,
    read_job,
    take_result_channel,
)
from trainer.control.policy_config import TrainConfig

log = logging.getLogger("trainer.learner.initial_adapter")  # not __name__: the process runs it as __main__


class BaseModelNotLoaded(Exception):
    """The loader refused the base model: no such directory or hub id, or no model in it."""


def write_initial_adapter(base_path: str, target: Path, train_config: TrainConfig) -> None:
    """Save a fresh LoRA for the base model at `target`, unless an earlier, interrupted create got that far (the
    directory is renamed in once complete)."""
    if target.exists():
        log.info("version 0 is already at %s", target)
        return
    try:
        _check_model_name(base_path)
        import torch

        from trainer.learner.model import load_policy, save_adapter

        model, _ = load_policy(base_path, None, train_config, torch.device("cpu"))
    except (OSError, ValueError) as exc:  # transformers' answers for no such model, directory or hub id
        raise BaseModelNotLoaded(" ".join(str(exc).split())) from exc
    save_adapter(model, target)


def _check_model_name(base_path: str) -> None:
    """Raise the loader's own error (a ValueError) for a name that is no directory and cannot be a hub id, before
    torch is imported: the refusal then takes a second instead of the imports' tens of seconds."""
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]  # exported lazily

    try:
        directory = Path(base_path).is_dir()
    except OSError:  # too long for the file system
        directory = False
    if not directory:
        validate_repo_id(base_path)


def main() -> int:
    result = take_result_channel()
    job = read_job(InitialAdapterJob)
    configure_child_logging(job.log_level)
    started = time.monotonic()
    target = Path(job.target)
    log.info("building version 0 at %s on %s", target, clip(job.base_model))
    try:
        write_initial_adapter(job.base_model, target, TrainConfig.model_validate(job.train))
    except BaseModelNotLoaded as exc:
        log.info("the base model could not be loaded: %s", clip(str(exc)))
        result.write(clip(str(exc)) + "\n")
        result.flush()
        return BASE_MODEL_UNAVAILABLE
    except Exception:
        log.exception("building version 0 at %s failed", target)
        return FAILED
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    log.info(
        "version 0 ready at %s in %.1f s (peak RSS %.0f MiB)", target, time.monotonic() - started, peak_mib
    )
    return DONE


if __name__ == "__main__":
    sys.exit(main())
