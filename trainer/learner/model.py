"""The policy model on the trainer side: base + LoRA (PEFT), local sampling, and atomic adapter writes.

Unsloth loads the base on a CUDA GPU when a policy asks for it (`train.loader`) and it is installed; otherwise
plain PyTorch + PEFT. LoRA weights stay float32 (their updates are tiny and would vanish in bf16) and compute runs
under bf16 autocast where the CPU/GPU supports bf16 (AVX512-BF16/AMX): there the frozen base is stored in bf16 too.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from storage.adapter_store import write_directory
from trainer.control.policy_config import TrainConfig
from trainer.control.rollouts import SampledTurn, hermes_message

logger = logging.getLogger(__name__)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def autocast(device: torch.device) -> Iterator[None]:
    """bf16 autocast where supported, a no-op elsewhere."""
    if bf16_supported(device):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


def uses_unsloth(device: torch.device, loader: str) -> bool:
    """Whether Unsloth loads the base: only when the policy asks for it (`train.loader`), on a CUDA device, where
    it is installed (the `gpu` extra). Opt-in because on an H100 it ran the same update slower than transformers +
    PEFT (docs/performance.md); a request it cannot meet falls back to PEFT with a warning, so a policy set up
    for a GPU server still trains elsewhere."""
    if loader != "unsloth":
        return False
    if device.type != "cuda":
        logger.warning(
            "train.loader is unsloth, which needs a CUDA device: loading the base with PEFT on %s", device
        )
        return False
    if importlib.util.find_spec("unsloth") is None:
        logger.warning(
            "train.loader is unsloth, which is not installed (pip install 'kaizen[gpu]'): loading the base with PEFT"
        )
        return False
    return True


def _load_base(base_path: str, device: torch.device, with_unsloth: bool) -> Any:
    from transformers import AutoModelForCausalLM

    if with_unsloth:
        from unsloth import FastLanguageModel  # type: ignore[import-not-found]

        logger.info("loading %s with Unsloth", base_path)
        model, _ = FastLanguageModel.from_pretrained(base_path, dtype=torch.bfloat16, load_in_4bit=False)
        return model
    # The base is frozen, so bf16 weights lose nothing where bf16 compute is used anyway: autocast no longer
    # re-casts every weight on every forward, and the copy in memory halves. LoRA weights stay float32 (PEFT).
    dtype = torch.bfloat16 if bf16_supported(device) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    return model.to(device)  # type: ignore[arg-type]


def load_policy(
    base_path: str, adapter_path: str | None, cfg: TrainConfig, device: torch.device
) -> tuple[Any, Any]:
    """Base model with the active adapter (trainable), or a fresh LoRA when the policy has no version yet."""
    with_unsloth = uses_unsloth(device, cfg.loader)
    if with_unsloth:
        # Unsloth patches transformers' and PEFT's classes when imported: it must come before them (on the H100
        # it warned "Unsloth should be imported before [transformers, peft]" when it did not).
        import unsloth  # type: ignore[import-not-found]  # noqa: F401
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoTokenizer

    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    base = _load_base(base_path, device, with_unsloth)
    if adapter_path is not None:
        logger.info("loading adapter %s", adapter_path)
        model = PeftModel.from_pretrained(base, adapter_path, is_trainable=True)
    else:
        logger.info("no active adapter: starting a fresh LoRA (rank %d)", cfg.lora_rank)
        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lora)
    model.to(device)
    if bf16_supported(device):
        _keep_lora_inputs_in_bf16(model)
    model.get_output_embeddings().register_forward_pre_hook(_contiguous_input)
    return model, tokenizer


#: The fewest forward and backward passes for which `train.compile = "auto"` compiles. On an H100 with a 3.1B model
#: (micro-batches of 8 sequences, about 140 tokens each) compiling took 45-47 s, once per training process, and
#: saved about 0.09 s a pass: a run pays it back after about 500 passes (docs/performance.md, "Training").
COMPILE_MIN_PASSES = 500


def compile_layers(model: Any, cfg: TrainConfig, device: torch.device, passes: int) -> bool:
    """Compile each decoder layer of `model` for the training passes, as `train.compile` asks; whether it did.

    `passes`: the forward and backward passes the run plans, which `auto` weighs against the compilation's cost.
    At a few thousand tokens a step, a GPU finishes each of a LoRA model's small kernels faster than Python
    launches the next: fused by the compiler, the same step launches far fewer. Regional compilation: every layer
    runs the same compiled graph (the layers differ only in their weights; the first, whose input needs no
    gradient, gets a second), with dynamic shapes, so micro-batches of new lengths do not compile again. Passes
    without autograd (sampling, collapse checks, reference logprobs) stay eager: their shapes change at every
    generated token, and they are not the step."""
    if cfg.compile == "off":
        return False
    if cfg.compile == "auto":
        if device.type != "cuda" or cfg.loader == "unsloth":  # Unsloth brings its own kernels: not measured
            return False
        if passes < COMPILE_MIN_PASSES:
            logger.info(
                "decoder layers not compiled: %d passes would not pay for compiling them (train.compile=auto "
                "compiles from %d; `on` always does)",
                passes,
                COMPILE_MIN_PASSES,
            )
            return False
    for layer in model.get_base_model().model.layers:
        layer.forward = _CompiledWhenTraining(layer.forward)
    logger.info(
        "decoder layers compiled for training (train.compile=%s): the first step compiles them", cfg.compile
    )
    return True


class _CompiledWhenTraining:
    """A layer's forward: compiled where autograd records the pass, eager otherwise."""

    def __init__(self, eager: Callable[..., Any]) -> None:
        self.eager = eager
        self.compiled = torch.compile(eager, dynamic=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def _contiguous_input(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Hands the vocabulary projection a contiguous input.

    With `logits_to_keep`, the model projects a slice of the hidden states, which is not contiguous. For an input
    that requires grad and cannot be flattened without a copy, torch's matmul does not fold [B, T, H] into one
    matrix product: it broadcasts the [H, V] weight to [B, H, V] (B copies of the embedding matrix) and runs a
    batched product, forward and backward. Copying the slice (B·T·H values) lets it fold; measured on the
    embedded model, this removed a fifth of a training step.
    """
    hidden, *rest = args
    return (hidden.contiguous(), *rest)


def _keep_lora_inputs_in_bf16(model: Any) -> None:
    """PEFT casts each LoRA layer's input to the float32 of its weights, and autocast casts it straight back to
    bf16 for the matmul: two copies of every activation entering a LoRA layer, forward and backward (a quarter
    of a CPU training step's time). Every trainer forward runs under `autocast`, which casts the small float32
    LoRA weights instead, so the activation casts are switched off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False  # type: ignore[attr-defined]


def save_adapter(model: Any, target: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the adapter to `target` complete or not at all (`storage.adapter_store`): no half-written version
    is ever visible, also when the disk fills up.

    `state_dict`: the trainable weights gathered from every training process, for a sharded model."""
    write_directory(target, lambda partial: model.save_pretrained(str(partial), state_dict=state_dict))


@dataclass(frozen=True)
class Sample:
    """One sampled reply as text, with the exact tokens and the behaviour logprobs of the sampler."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None


class LocalSampler:
    """Samples from the trainer's own copy of the active adapter with HF generate.

    Temperature 1 with no top-k/top-p keeps the recorded logprobs exactly those of the policy being trained.
    """

    #: One model, one generate call at a time.
    max_concurrency = 1
    #: Several training processes sample in lockstep (a sharded model needs all of them for every token).
    synced = False

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]

    async def sample(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        n: int,
        options: Mapping[str, Any] | None = None,
    ) -> list[SampledTurn]:
        """`n` turns answering `messages`, tool calls read from the text in the Hermes format (`<tool_call>`
        blocks, the embedded model's). HF generate cannot force a tool call: `options` are not applied."""
        # In a worker thread: generation blocks for seconds, and the run's lock heartbeat must keep beating.
        samples = (await asyncio.to_thread(self.sample_many, [(messages, tools)], n))[0]
        eos = self.tokenizer.eos_token_id
        return [
            SampledTurn(
                message=hermes_message(sample.text)
                if tools
                else {"role": "assistant", "content": sample.text},
                finish_reason="stop" if sample.token_ids and sample.token_ids[-1] == eos else "length",
                prompt_token_ids=sample.prompt_token_ids,
                token_ids=sample.token_ids,
                logprobs=sample.logprobs,
            )
            for sample in samples
        ]

    def sample_many(
        self, contexts: list[tuple[list[dict[str, Any]], list[Any] | None]], n: int
    ) -> list[list[Sample]]:
        """`n` replies to each context in one left-padded generate call (per-step overhead dominates on CPU).

        No autograd either way; not inference mode when synced: a sharded model's gathered weights are buffers
        that training writes into afterwards, which inference tensors refuse."""
        with torch.no_grad() if self.synced else torch.inference_mode():
            return self._sample_many(contexts, n)

    def _sample_many(
        self, contexts: list[tuple[list[dict[str, Any]], list[Any] | None]], n: int
    ) -> list[list[Sample]]:
        if n <= 0 or not contexts:
            return [[] for _ in contexts]
        prompts = [self.prompt_ids(messages, tools) for messages, tools in contexts]
        width = max(len(p) for p in prompts)
        pad = int(self.tokenizer.pad_token_id)
        inputs = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with autocast(self.device):
                out = self.model.generate(
                    input_ids=inputs,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=self.temperature,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=self.max_new_tokens,
                    num_return_sequences=n,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=pad,
                    synced_gpus=self.synced,
                )
        finally:
            self.model.train(was_training)
        new = out.sequences[:, width:]
        # scores are the processed logits (temperature applied): the distribution actually sampled from.
        picked = torch.stack(
            [
                torch.log_softmax(s.float(), dim=-1).gather(-1, new[:, i : i + 1]).squeeze(-1)
                for i, s in enumerate(out.scores)
            ],
            dim=1,
        )
        eos = self.tokenizer.eos_token_id
        results: list[list[Sample]] = []
        for c, prompt in enumerate(prompts):
            samples = []
            for row in range(c * n, (c + 1) * n):
                ids = [int(t) for t in new[row]]
                if eos in ids:
                    ids = ids[: ids.index(eos) + 1]
                lps = [float(v) for v in picked[row, : len(ids)]]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                samples.append(Sample(text=text, prompt_token_ids=prompt, token_ids=ids, logprobs=lps))
            results.append(samples)
        return results
