"""How one training run is started on several processes: torchrun's command line, and the rank each process
reads from the environment torchrun gives it. No torch here: the gateway builds the command it starts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes."""

    rank: int
    world: int
    local_rank: int

    @property
    def main(self) -> bool:
        return self.rank == 0


def ranks_from_environment(env: Mapping[str, str] | None = None) -> Ranks | None:
    """The ranks torchrun gave this process (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`); None when it runs alone."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    return Ranks(int(env["RANK"]), world, int(env.get("LOCAL_RANK", "0")))


def torchrun_command(python: str, processes: int) -> list[str]:
    """`python -m trainer.learner` as `processes` processes on this machine (one per GPU), through torchrun as
    `trainer.learner.torchrun` wraps it: a stop by signal or a failed run ends in a log line and an exit status,
    not a traceback. Every process inherits the launcher's stdin; rank 0 reads the job from it."""
    return [
        python, "-m", "trainer.learner.torchrun", "--standalone", "--nproc-per-node", str(processes),
        "-m", "trainer.learner",
    ]  # fmt: skip
