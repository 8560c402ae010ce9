"""How the gateway and the control plane start and stop the processes they own: the capture writer, serving
workers, model jobs and training children (our own modules), and vLLM (another interpreter).

Here rather than in `gateway`, because the control plane starts children too and may not import the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
from collections.abc import Sequence
from pathlib import Path

#: The directory that holds the `gateway`, `trainer` and `storage` packages in use.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

#: Runs first in the child's interpreter: ask Linux for a signal (argv[2]) when the parent dies, even by SIGKILL
#: (the request survives the exec), with its default action (an ignored signal stays ignored through the exec, and
#: `nohup` ignores SIGHUP), stop if the parent is already gone, then exec the child's command unchanged. Source,
#: not a module: vLLM's interpreter cannot import ours (`die_with_parent` is the same request, for our own code).
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
signal.signal(int(sys.argv[2]), signal.SIG_DFL)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(sys.argv[2]))  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.executable, [sys.executable, *sys.argv[3:]])
"""

#: A training child's parent-death signal: one that nothing else sends it (it runs in a session of its own, with
#: no terminal to hang up), so the child knows why it stops and its run says so.
PARENT_DEATH_SIGNAL = signal.SIGHUP


def own_modules_environment() -> dict[str, str]:
    """The environment of a child that runs one of our modules (`python -m ...`): this checkout first on its path,
    so it runs the same code as its parent whatever its working directory and whatever else is installed."""
    path = [PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}


#: prctl's option for the parent-death signal (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: signal.Signals) -> None:
    """Ask Linux for `signum` when this process's parent dies (elsewhere nothing changes), and take it at once if
    the parent is no longer `parent_pid`: for a process of ours that another program started (torchrun's
    trainers); those we start ourselves ask before they exec (`dying_with_parent`)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    except (AttributeError, OSError):
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def dying_with_parent(command: Sequence[str], signum: signal.Signals = signal.SIGTERM) -> list[str]:
    """`command` (a Python interpreter and its arguments) started so that it gets `signum` when this process dies
    (Linux; elsewhere it runs unchanged): for children that would otherwise outlive a SIGKILLed parent. Spawn it
    from the thread that lives as long as it should (the event loop's): Linux ties the signal to that thread."""
    return [command[0], "-c", _DIE_WITH_PARENT, str(os.getpid()), str(int(signum)), *command[1:]]


def signal_group(pgid: int, signum: int) -> None:
    """Signal a child started with `start_new_session=True` and every process it started, if any is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


async def stop_group(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM to the child's process group, then, after `grace_s`, SIGKILL to what is left of it: a SIGKILL to
    the child alone would leave the processes it started (vLLM's engine core) running. torchrun's ranks, in
    sessions of their own, die with torchrun (`trainer.learner.torchrun`)."""
    signal_group(process.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(process.wait()), grace_s)
    signal_group(process.pid, signal.SIGKILL)
    await process.wait()
