"""`python -m trainer.torchrun`: torch's elastic launcher (torchrun, same arguments) as Kaizen starts it.

A stop by signal is how Kubernetes, a scheduler or Ctrl-C end a run, not a crash: torchrun hands the signal to
every trainer and then raises it out of its main function as an exception. Plain torchrun prints that as a
traceback and exits 1; here it ends in one log line and 128 + the signal's number, as `python -m trainer` does.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun on `argv` (default: this process's arguments); 0 when every process succeeded."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(None if argv is None else list(argv))
    except SignalException as stop:
        log.warning("torchrun stopped by %s; it stopped every training process first", stop.sigval.name)
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main())
