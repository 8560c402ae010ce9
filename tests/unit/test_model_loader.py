"""Which library loads the base (`train.loader`): PEFT unless a policy opts into Unsloth where it can run."""

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch

from trainer.control.policy_config import TrainConfig
from trainer.learner import model
from trainer.learner.model import load_policy, uses_unsloth

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
CPU = torch.device("cpu")


def pretend_unsloth(monkeypatch: pytest.MonkeyPatch, *, installed: bool) -> None:
    """`find_spec` answers for Unsloth as it would with (or without) the `gpu` extra installed."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "unsloth":
            return object() if installed else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(model.importlib.util, "find_spec", find_spec)


@pytest.fixture
def unsloth_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_unsloth(monkeypatch, installed=True)


def test_the_default_is_peft_even_on_a_gpu_where_unsloth_is_installed(unsloth_installed: None) -> None:
    assert TrainConfig().loader == "peft"
    assert not uses_unsloth(CUDA, TrainConfig().loader)


def test_a_policy_that_asks_for_unsloth_gets_it_on_a_gpu_where_it_is_installed(
    unsloth_installed: None,
) -> None:
    assert uses_unsloth(CUDA, TrainConfig(loader="unsloth").loader)


@pytest.mark.parametrize(
    ("device", "installed", "reason"),
    [(CPU, True, "needs a CUDA device"), (CUDA, False, "is not installed")],
)
def test_unsloth_it_cannot_use_falls_back_to_peft_with_a_warning(
    device: torch.device,
    installed: bool,
    reason: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pretend_unsloth(monkeypatch, installed=installed)
    with caplog.at_level(logging.WARNING, logger=model.logger.name):
        assert not uses_unsloth(device, "unsloth")
    assert reason in caplog.text


def test_an_unknown_loader_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="loader"):
        TrainConfig(loader="vllm")  # type: ignore[arg-type]


def test_a_policy_set_up_for_unsloth_still_trains_on_a_cpu(tiny_model_dir: Path) -> None:
    peft_model, _ = load_policy(str(tiny_model_dir), None, TrainConfig(loader="unsloth"), CPU)
    assert type(peft_model).__name__ == "PeftModelForCausalLM"
    assert any(p.requires_grad for p in peft_model.parameters())
