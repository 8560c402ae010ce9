"""The update loop's batching, the trainer's model set-up and the collapse monitor: faster, and the same maths."""

from pathlib import Path

import pytest
import torch

from trainer.control.collapse import CollapseBounds
from trainer.control.policy_config import TrainConfig
from trainer.learner.batch import TokenizedSample, collate
from trainer.learner.grpo import CollapseMonitor, _forward_logprobs, plan_steps, planned_passes, run_update
from trainer.learner.model import (
    COMPILE_MIN_PASSES,
    LocalSampler,
    _CompiledWhenTraining,
    bf16_supported,
    compile_layers,
    load_policy,
)


def test_plan_steps_keeps_the_shuffled_steps_and_sorts_each_by_length() -> None:
    order = [4, 9, 0, 7, 2, 5, 8, 1, 3, 6]
    lengths = [10, 50, 20, 40, 30, 60, 15, 45, 25, 35]

    steps = plan_steps(order, lengths, micro_batch=2, accumulation=2)

    # Which samples share an optimizer step is the shuffle's choice; the last step takes the remainder.
    assert [sorted(i for mb in step for i in mb) for step in steps] == [
        sorted(order[0:4]),
        sorted(order[4:8]),
        sorted(order[8:]),
    ]
    assert [len(mb) for step in steps for mb in step] == [2, 2, 2, 2, 2]
    for step in steps:
        flat = [i for mb in step for i in mb]
        assert [lengths[i] for i in flat] == sorted((lengths[i] for i in flat), reverse=True)


def test_plan_steps_puts_similar_lengths_together() -> None:
    lengths = [100, 5, 100, 5]

    steps = plan_steps([0, 1, 2, 3], lengths, micro_batch=2, accumulation=2)

    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in steps[0])
    assert padded == sum(lengths)  # no padding at all, where the shuffle would have padded two short samples


def test_trainer_model_gives_the_logprobs_and_gradients_of_plain_peft(tiny_model_dir: Path) -> None:
    """`load_policy` keeps LoRA inputs in bf16 and hands the vocabulary projection a contiguous slice; the
    logprobs and LoRA gradients must match a PEFT model set up the default way, under the same autocast."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(lora_rank=4, lora_alpha=8, seed=0)
    device = torch.device("cpu")
    fast, _ = load_policy(str(tiny_model_dir), None, cfg, device)
    torch.manual_seed(cfg.seed)
    dtype = torch.bfloat16 if bf16_supported(device) else torch.float32
    plain = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype),
        LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=cfg.target_modules, task_type="CAUSAL_LM"
        ),
    )
    # LoRA B starts at zero; give both models the same non-zero adapter so the LoRA path matters.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p_fast, p_plain in zip(fast.parameters(), plain.parameters(), strict=True):
            if p_fast.requires_grad:
                values = torch.randn(p_fast.shape, generator=generator) * 0.1
                p_fast.copy_(values)
                p_plain.copy_(values)
    samples = [
        TokenizedSample([3, 4, 5, 6, 7, 8, 9, 10], [False] * 3 + [True] * 5, [None] * 8, 1.0),
        TokenizedSample([3, 4, 11, 12], [False] * 2 + [True] * 2, [None] * 4, -1.0),
    ]
    batch = collate(samples, pad_id=0)
    start = 1  # a non-contiguous slice of the hidden states, as in the update loop

    results = []
    for model in (fast, plain):
        model.train()
        logprobs = _forward_logprobs(model, batch, device, start)
        logprobs[batch.loss_mask[:, start:]].sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((logprobs.detach(), grads))

    (lp_fast, g_fast), (lp_plain, g_plain) = results
    mask = batch.loss_mask[:, start:]
    # Measured identical to the bit; the tolerance only allows another summation order on other CPUs.
    torch.testing.assert_close(lp_fast[mask], lp_plain[mask], atol=1e-5, rtol=1e-4)
    assert g_fast.keys() == g_plain.keys() and g_fast
    for name in g_fast:
        torch.testing.assert_close(g_fast[name], g_plain[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_collapse_monitor_measures_kl_to_where_the_run_started_and_restores_its_weights(
    tiny_model_dir: Path,
) -> None:
    """KL to the run's start comes from the start's LoRA weights swapped in for one pass (not from the base
    model), and the trained weights come back bit for bit; the replies are scored for reward evidence."""
    device = torch.device("cpu")
    cfg = TrainConfig(
        lora_rank=4, lora_alpha=8, collapse_prompts=2, collapse_samples=8, collapse_max_new_tokens=6
    )
    model, tokenizer = load_policy(str(tiny_model_dir), None, cfg, device)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    contexts = [([{"role": "user", "content": "t3"}], None), ([{"role": "user", "content": "t6"}], None)]
    scored: list[tuple[int, int]] = []

    def score(index: int, replies: list[str]) -> list[float | None]:
        scored.append((index, len(replies)))
        return [float(index)] * len(replies)

    trainable = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(2)

    def move() -> list[torch.Tensor]:
        with torch.no_grad():
            for param in trainable:
                param.add_(torch.randn(param.shape, generator=generator))
        return [p.detach().clone() for p in trainable]

    move()  # the run starts from an adapter that is not the base model
    torch.manual_seed(0)
    monitor = CollapseMonitor(model, tokenizer, contexts, cfg, device, CollapseBounds(), score)
    baseline = monitor.start()
    assert baseline.kl_to_start == 0.0 and baseline.kl_to_base != 0.0
    assert baseline.reward == 0.5 and scored == [(0, 8), (1, 8)]

    monitor(1)  # not moved since the start: no distance to it, whatever the distance to the base
    still = monitor.history[-1]
    assert still["kl_to_start"] == pytest.approx(0.0, abs=1e-6) and abs(still["kl_to_base"]) > 1e-4

    trained = move()
    monitor(2)
    assert abs(monitor.history[-1]["kl_to_start"]) > 1e-4
    assert all(torch.equal(p, t) for p, t in zip(trainable, trained, strict=True))


@pytest.mark.parametrize(
    ("samples", "micro", "accumulation", "epochs"), [(16, 8, 2, 1), (37, 4, 3, 2), (5, 8, 2, 3)]
)
def test_planned_passes_are_the_micro_batches_plan_steps_makes(
    samples: int, micro: int, accumulation: int, epochs: int
) -> None:
    cfg = TrainConfig(micro_batch_size=micro, grad_accumulation=accumulation, epochs=epochs)
    steps = plan_steps(list(range(samples)), [10] * samples, micro, accumulation)

    assert planned_passes(samples, cfg) == sum(len(step) for step in steps) * epochs


def test_train_compile_auto_compiles_a_long_run_on_a_gpu_only(tiny_model_dir: Path) -> None:
    """`auto` weighs the run's passes against compiling's cost, on a GPU only; nothing compiles until a pass runs,
    so a model on the CPU stands in for one on a GPU here."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    decisions = []
    for mode, device, passes, loader in [
        ("auto", cpu, COMPILE_MIN_PASSES, "peft"),
        ("auto", cuda, COMPILE_MIN_PASSES - 1, "peft"),
        ("auto", cuda, COMPILE_MIN_PASSES, "peft"),
        ("auto", cuda, COMPILE_MIN_PASSES, "unsloth"),
        ("off", cuda, COMPILE_MIN_PASSES, "peft"),
        ("on", cpu, 1, "peft"),
    ]:
        cfg = TrainConfig(lora_rank=4, lora_alpha=8, compile=mode, loader=loader)
        model, _ = load_policy(str(tiny_model_dir), None, cfg, cpu)
        compiled = compile_layers(model, cfg, device, passes)
        layers = model.get_base_model().model.layers
        assert all(isinstance(layer.forward, _CompiledWhenTraining) == compiled for layer in layers)
        decisions.append(compiled)

    assert decisions == [False, False, True, False, False, True]


def test_compiled_layers_train_as_eager_ones_and_passes_without_autograd_stay_eager(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`train.compile = "on"` on the CPU: the logprobs and LoRA gradients of eager layers, one compiled graph for
    micro-batches of new lengths, and sampling and other passes without autograd left eager. In float32: in bf16
    the compiler's fused kernels round differently from eager ones (about 1% of a gradient on this CPU)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("trainer.learner.model.bf16_supported", lambda device: False)
    device = torch.device("cpu")
    samples = [
        TokenizedSample([3, 4, 5, 6, 7, 8, 9, 10], [False] * 3 + [True] * 5, [None] * 8, 1.0),
        TokenizedSample([3, 4, 11, 12], [False] * 2 + [True] * 2, [None] * 4, -1.0),
        TokenizedSample([3, 5, 6, 13, 14, 15], [False] * 3 + [True] * 3, [None] * 6, 0.5),
        TokenizedSample([3, 7, 16], [False] * 2 + [True], [None] * 3, -0.5),
    ]
    batch = collate(samples, pad_id=0)
    results = {}
    torch._dynamo.reset()
    counters.clear()
    for mode in ("off", "on"):
        cfg = TrainConfig(lora_rank=4, lora_alpha=8, micro_batch_size=2, grad_accumulation=1, compile=mode)
        model, tokenizer = load_policy(str(tiny_model_dir), None, cfg, device)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the same non-zero adapter in both, so the LoRA path matters
            for param in model.parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        assert compile_layers(model, cfg, device, passes=1) == (mode == "on")
        model.train()
        logprobs = _forward_logprobs(model, batch, device)
        logprobs[batch.loss_mask].sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[mode] = (logprobs.detach(), grads)
        if mode == "on":
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 1  # the layers ran compiled
            run_update(model, samples, cfg, pad_id=0, device=device)  # micro-batches of two other lengths
            tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
            LocalSampler(model, tokenizer, device, max_new_tokens=4).sample_many(
                [([{"role": "user", "content": "t3 t4"}], None)], 2
            )
            with torch.no_grad():
                _forward_logprobs(model, batch, device)
            assert counters["stats"]["unique_graphs"] == graphs

    (lp_eager, g_eager), (lp_compiled, g_compiled) = results["off"], results["on"]
    mask = batch.loss_mask
    torch.testing.assert_close(lp_compiled[mask], lp_eager[mask], atol=1e-5, rtol=1e-4)
    assert g_eager.keys() == g_compiled.keys() and g_eager
    for name in g_eager:
        torch.testing.assert_close(g_compiled[name], g_eager[name], atol=1e-5, rtol=1e-4)
