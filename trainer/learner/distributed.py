"""Training one adapter on several processes (one per GPU, on one node or many) with PyTorch's own engines.

`torchrun` (`python -m trainer.learner.torchrun`, see `trainer.control.launch`) starts the processes, each running
`python -m trainer.learner`. Rank 0 is the run: it holds the job lock, reads the data, resamples and
scores, writes the adapter and the run's rows. The others follow: they load the same model, receive the samples
from rank 0, and take part in every optimizer step. The model is wrapped with FSDP (`fully_shard`: the frozen base
is sharded across the processes, so a base too big for one GPU fits on several; LoRA layers are sharded groups of
their own, as they are float32 beside a bf16 base) or DDP (each process holds the whole model). Each step's
micro-batches are dealt out to the processes; every process runs the same number of forward/backward passes (one
with no micro-batch left runs a zero-weighted one, since every pass takes part in the gradient collectives), and
the loss is scaled so that the gradients the engine reduces are the step's sum, exactly as one process computes
it (`tests/integration/test_distributed_training.py` checks that).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from trainer.control.launch import Ranks

logger = logging.getLogger(__name__)

T = TypeVar("T")

Sharding = Literal["fsdp", "ddp"]
#: How long a process waits in a collective: rank 0 reads, resamples and scores while the others wait.
COLLECTIVE_TIMEOUT = timedelta(hours=6)


def start(ranks: Ranks) -> torch.device:
    """Join the process group (NCCL between GPUs, gloo on CPUs) and return this process's device."""
    if torch.cuda.is_available():
        torch.cuda.set_device(ranks.local_rank)
        device, backend = torch.device("cuda", ranks.local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    logger.info("training process %d of %d on %s (%s)", ranks.rank, ranks.world, device, backend)
    return device


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def share(value: T | None, ranks: Ranks) -> T | None:
    """Rank 0's `value`, on every rank (the others pass anything)."""
    box = [value if ranks.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Followers:
    """Rank 0's side of the hand-off to the other processes, which wait for two messages (what to load, then
    the samples to train on; None instead of either ends their run). `release` sends what is still owed when the
    run ends early (skipped, or the job lock was taken), so they do not wait out the collective timeout."""

    STAGES = 2

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.told = 0

    def tell(self, message: Any) -> None:
        share(message, self.ranks)
        self.told = self.STAGES if message is None else self.told + 1

    def release(self) -> None:
        if self.told < self.STAGES:
            self.tell(None)


def shard(model: Any, sharding: Sharding, device: torch.device) -> Any:
    """Wrap the PEFT model for training on every process."""
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    from peft.tuners.lora import LoraLayer
    from torch.distributed.fsdp import fully_shard

    # Innermost first: each LoRA matrix is a float32 group, each decoder layer's frozen weights another, the rest
    # (embeddings, final norm, the vocabulary projection) the root's; FSDP needs one dtype per group.
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in (*module.lora_A.values(), *module.lora_B.values()):
                fully_shard(adapter)
    for layer in _decoder_layers(model):
        fully_shard(layer)
    # The root group is the causal LM inside PEFT: training calls the PEFT model, but generation (the collapse
    # checks) calls the causal LM's forward directly, and the root's hooks must run either way.
    fully_shard(model.get_base_model())
    return model


def _decoder_layers(model: Any) -> Sequence[Any]:
    """The transformer blocks of a Hugging Face causal LM under PEFT (`model.model.layers` for Llama-like)."""
    base = model.get_base_model()
    inner = getattr(base, "model", base)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(base).__name__} to shard")
    return list(layers)


def my_micro_batches(window: Sequence[list[int]], ranks: Ranks) -> list[list[int] | None]:
    """This rank's micro-batches of an optimizer step, dealt out in turn, padded with None (a zero-weighted pass)
    so that every rank runs as many as the busiest one."""
    mine: list[list[int] | None] = list(window[ranks.rank :: ranks.world])
    passes = -(-len(window) // ranks.world)
    return mine + [None] * (passes - len(mine))


def gather_objects(value: T, ranks: Ranks) -> list[T]:
    """Every rank's `value`, in rank order, on every rank."""
    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, value)
    return out


def full_trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) weights as whole tensors on the CPU, gathered from every rank (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = model.module if hasattr(model, "module") else model
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    return {
        name: tensor
        for name, tensor in state.items()
        if name in trainable and isinstance(tensor, torch.Tensor)
    }
