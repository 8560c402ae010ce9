"""The one typed policy configuration: defaults, configurations stored before it existed, and one error that
names every problem."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from trainer.control.policy_config import (
    DEFAULT_RUBRIC,
    InvalidPolicyConfig,
    PolicyConfig,
    load_policy_config,
)


def test_defaults_close_the_loop_and_round_trip() -> None:
    config = load_policy_config({})
    assert config == load_policy_config(None) == PolicyConfig()
    assert load_policy_config(config.model_dump(mode="json")) == config
    assert not config.schedule.paused
    assert config.schedule.judge_interval_s == 3600
    assert config.schedule.train_cron == "0 3 * * *"
    assert config.schedule.train_min_new_episodes is None
    assert config.schedule.retention.calls_days == 90 and config.schedule.retention.keep_versions == 5
    assert (config.train.grouping, config.train.group_size, config.train.learning_rate) == (
        "resample",
        8,
        5e-5,
    )
    assert (config.train.clip_low, config.train.clip_high, config.train.tis_cap, config.train.kl_coef) == (
        0.2,
        0.28,
        2.0,
        0.0,
    )
    assert (config.gate.holdout_fraction, config.gate.samples, config.gate.tolerance) == (0.1, 4, 0.02)
    assert config.rewards.rule.priority == ["feedback", "function", "webhook", "judge"]
    assert config.rewards.scorer.kind == "judge" and config.rewards.judge.rubric == DEFAULT_RUBRIC


# Shapes found in `policies.config` before the sections shared one type: numbers written as ints or strings
# (the pydantic sections coerced them), sections set to null, and sections left out.
STORED: list[dict[str, Any]] = [
    {},
    {"train": None, "rewards": None},
    {"train": {"learning_rate": "1e-4", "group_size": 4, "collapse_bounds": {"max_kl_to_base": 1}}},
    {"schedule": {"paused": True, "train_cron": None, "train_min_new_episodes": 50}, "rewards": {}},
    {
        "rewards": {
            "feedback": {"labels": {"great": 2}, "true_value": 1, "false_value": -1, "min_value": 0},
            "rule": {"kind": "weighted", "weights": {"judge": 1, "feedback:user": 3}, "normalize": False},
            "scorer": {"webhook_url": "http://scorer.test/score", "webhook_retries": 0},
            "judge": {"rubric": "R", "model": "m"},
        },
        "gate": {"holdout_fraction": 0.2, "promote": False, "collapse_bounds": {"min_distinct_share": 0.1}},
        "schedule": {"judge_interval_s": None, "retention": {"cron": None, "calls_days": None}},
    },
]


@pytest.mark.parametrize("stored", STORED)
def test_configurations_stored_before_still_load(stored: dict[str, Any]) -> None:
    config = load_policy_config(stored)
    for section, values in stored.items():
        for key, value in (values or {}).items():
            if not isinstance(value, dict):
                assert getattr(getattr(config, section), key) == (
                    float(value) if key == "learning_rate" else value
                )
    assert load_policy_config(config.model_dump(mode="json")) == config


def test_one_error_names_every_problem_in_every_section() -> None:
    bad = {
        "rewards": {"rule": {"kind": "median"}, "labelz": {}},
        "train": {"lerning_rate": 1e-4, "group_size": 1},
        "schedule": {"train_cron": "every night", "retention": {"keep_versions": 0}},
        "gate": {"samples": "many", "collapse_bounds": {"max_kl": 1.0}},
        "trian": {},
    }
    with pytest.raises(InvalidPolicyConfig) as raised:
        load_policy_config(bad)
    problems = {problem.path: problem.message for problem in raised.value.problems}
    assert set(problems) == {
        "rewards.rule.kind",
        "rewards.labelz",
        "train.lerning_rate",
        "train.group_size",
        "schedule.train_cron",
        "schedule.retention.keep_versions",
        "gate.samples",
        "gate.collapse_bounds",
        "trian",
    }
    assert problems["train.lerning_rate"] == problems["trian"] == "unknown key"
    assert "max_kl" in problems["gate.collapse_bounds"]
    assert "greater than or equal to 2" in problems["train.group_size"]
    message = str(raised.value)
    assert message.startswith("invalid policy configuration (9 problems): ")
    assert all(f"{path}: {text}" in message for path, text in problems.items())


@pytest.mark.parametrize(
    ("config", "path"),
    [
        ({"schedule": {"retention": {"cron": "61 * * * *"}}}, "schedule.retention.cron"),
        ({"schedule": {"judge_interval_s": 0}}, "schedule.judge_interval_s"),
        ({"schedule": {"train_min_new_episodes": 0}}, "schedule.train_min_new_episodes"),
        ({"schedule": {"unknown": 1}}, "schedule.unknown"),
        ({"train": {"target_modules": ["q_proj", 3]}}, "train.target_modules[1]"),
        ({"rewards": {"feedback": {"labels": {"good": "yes"}}}}, "rewards.feedback.labels.good"),
        ([], "(the configuration)"),
    ],
)
def test_each_bad_value_is_named_by_its_path(config: Any, path: str) -> None:
    with pytest.raises(InvalidPolicyConfig) as raised:
        load_policy_config(config)
    assert [problem.path for problem in raised.value.problems] == [path]


def test_train_overrides_replace_keys_of_the_train_section_and_are_validated() -> None:
    stored = {"train": {"learning_rate": 1e-4, "epochs": 3}}
    config = load_policy_config(stored, train_overrides={"epochs": 1})
    assert (config.train.learning_rate, config.train.epochs) == (1e-4, 1)
    with pytest.raises(InvalidPolicyConfig, match=r"train\.epochs: .*; train\.nope: unknown key"):
        load_policy_config(stored, train_overrides={"epochs": 0, "nope": 1})


def test_importing_the_configuration_loads_neither_torch_nor_polars() -> None:
    """The serving process validates configurations and must start without the training stack."""
    probe = (
        "import sys, trainer.control.policy_config\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'polars')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _leaf_keys(model: type[BaseModel]) -> set[str]:
    """The names of a section's settings, nested sections flattened (their own fields, not their name)."""
    keys = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= _leaf_keys(annotation)
        else:
            keys.add(name)
    return keys


@pytest.mark.parametrize("section", sorted(PolicyConfig.model_fields))
def test_every_key_is_in_the_configuration_table(section: str) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = re.search(rf"### `{section}`\n(.*?)(?=\n### |\Z)", page, re.S)
    assert table is not None, f"docs/configuration.md has no `{section}` section"
    named = set()
    for row in re.findall(r"^\| (.*?) \|", table.group(1), re.M):
        named |= {name.rsplit(".", 1)[-1] for name in re.findall(r"`([\w.]+)`", row)}
    annotation = PolicyConfig.model_fields[section].annotation
    assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
    missing = _leaf_keys(annotation) - named
    assert not missing, f"`{section}` keys missing from docs/configuration.md: {sorted(missing)}"
