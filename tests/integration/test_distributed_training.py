"""Training on several processes through PyTorch's engines (torchrun, FSDP or DDP, gloo on CPUs) takes the same
step as one process: the LoRA gradients of one optimizer step of the embedded model, computed by two processes
that split its micro-batches, match those of one process computing them all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# Two float32 sums of the same terms in another order: equal to a few parts in 10⁷. A step that counted one
# process's share twice, or halved it (the engine averages), is off by a factor of two.
RELATIVE_TOLERANCE = 1e-5


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
def alone(embedded_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The step's gradients computed by one process."""
    return step_gradients(embedded_model, tmp_path_factory.mktemp("alone") / "one.pt", 1, "fsdp")


@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_two_processes_take_the_step_one_process_takes(
    sharding: str, alone: dict[str, torch.Tensor], embedded_model: Path, tmp_path: Path
) -> None:
    together = step_gradients(embedded_model, tmp_path / "two.pt", 2, sharding)
    assert set(together) == set(alone) and len(alone) > 100  # every LoRA matrix of every layer
    assert all(g.abs().max() > 0 for g in alone.values())
    for name, expected in alone.items():
        scale = float(expected.abs().max())
        difference = float((together[name] - expected).abs().max())
        assert difference <= RELATIVE_TOLERANCE * scale, (name, difference, scale)
