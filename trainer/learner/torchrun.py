"""`python -m trainer.learner.torchrun`: torch's elastic launcher (torchrun, same arguments) as Kaizen starts it.

Two of torchrun's ends are not crashes of the launcher, yet plain torchrun prints each as a traceback and exits 1:
- a stop by signal (Kubernetes, a scheduler, Ctrl-C): torchrun hands the signal to every trainer, then raises it
  out of its main function. Here it ends in one log line and 128 + the signal's number.
- a trainer that exits non-zero, as `python -m trainer.learner` does (3) when its run was skipped or failed. Here
  torchrun's summary of the failed processes is logged and the command exits with the status of the first
  process that failed (torchrun's root cause), so a run on several processes exits as the same run on one
  process would. Not rank 0's: when another rank fails first, torchrun stops rank 0 itself, with SIGTERM.

torchrun starts every trainer in a session of its own, so a SIGKILL to torchrun's process group (the end of a
stop that took too long) does not reach them, and nothing stops them once torchrun is gone: they would train on,
or wait for hours in a collective, holding their GPUs. So each trainer it starts here asks Linux for a SIGKILL
when torchrun dies (`die_with_launcher`). A torchrun of one's own (several machines) keeps its own ways.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from trainer.control.child_processes import die_with_parent

log = logging.getLogger("trainer.learner.torchrun")  # also when run as __main__

#: torchrun's process id, in the environment of the trainers it starts here.
LAUNCHER_PID = "KAIZEN_TORCHRUN_PID"


def main() -> int:
    """Run torchrun on this process's arguments; 0 when every training process succeeded."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ[LAUNCHER_PID] = str(os.getpid())
    try:
        torchrun_main()
    except SignalException as stop:
        log.warning("torchrun stopped by %s; it stopped every training process first", stop.sigval.name)
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        log.error("training processes failed; torchrun's summary:%s", failed)  # its message is the summary
        # The processes torchrun stopped after it are recorded later, so the earliest record is the one that
        # failed by itself. Non-zero; -n: killed by signal n.
        code = failed.get_first_failure()[1].exitcode
        return 128 - code if code < 0 else code
    return 0


def die_with_launcher() -> None:
    """In a trainer started by `main`: be SIGKILLed when torchrun dies (Linux; elsewhere nothing changes). A
    trainer whose torchrun died before it asked ends at once."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is not None:
        die_with_parent(int(launcher), signal.SIGKILL)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
