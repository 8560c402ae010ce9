"""`python -m trainer.torchrun`: torch's elastic launcher (torchrun, same arguments) as Kaizen starts it.

Two of torchrun's ends are not crashes of the launcher, yet plain torchrun prints each as a traceback and exits 1:
- a stop by signal (Kubernetes, a scheduler, Ctrl-C): torchrun hands the signal to every trainer, then raises it
  out of its main function. Here it ends in one log line and 128 + the signal's number.
- a trainer that exits non-zero, as `python -m trainer` does (3) when its run was skipped or failed. Here
  torchrun's summary of the failed processes is logged and the command exits with the status of rank 0 (the
  run), so a run on several processes exits as the same run on one process would.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

log = logging.getLogger("trainer.torchrun")  # also when run as __main__


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun on `argv` (default: this process's arguments); 0 when every process succeeded."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(None if argv is None else list(argv))
    except SignalException as stop:
        log.warning("torchrun stopped by %s; it stopped every training process first", stop.sigval.name)
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        log.error("training processes failed; torchrun's summary:%s", failed)  # its message is the summary
        failure = failed.failures.get(0) or failed.get_first_failure()[1]
        return exit_status(failure.exitcode)
    return 0


def exit_status(exitcode: int) -> int:
    """A process's status as a shell reports it: a negative exit code is death by that signal (128 + its number);
    0 (a process that exited cleanly yet counted as failed) is 1."""
    if exitcode < 0:
        return 128 - exitcode
    return exitcode or 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
