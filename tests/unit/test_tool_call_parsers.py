"""The vLLM tool-call parser follows the base model's chat template, wherever the model comes from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gateway.app import build_vllm_engine
from gateway.base_models import CHAT_TEMPLATES_DIR
from gateway.engines.vllm import VLLMEngine
from gateway.settings import Settings
from gateway.tool_call_parsers import choose_tool_call_parser, model_chat_template, parser_for_template

EMBEDDED_TEMPLATE = CHAT_TEMPLATES_DIR / "smollm2_tools.jinja"


def _model_dir(root: Path, *, jinja: str | None = None, config_template: object = None) -> Path:
    """A Hugging Face model directory as far as its tokenizer files go."""
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if config_template is not None:
        config["chat_template"] = config_template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize(
    ("snippet", "parser"),
    [
        ("{{- '<tool_call>\\n' + call | tojson + '\\n</tool_call>' }}", "hermes"),
        ("<tool_call>\n<function={{ name }}>\n<parameter=", "qwen3_coder"),
        ("{{- '[TOOL_CALLS]' + calls | tojson }}", "mistral"),
        ("{{- '<|python_tag|>' + call }}", "llama3_json"),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "deepseek_v3"),
        ("{{- '<|im_start|>assistant\\n' + message.content }}", None),
    ],
)
def test_parser_follows_the_templates_markers(snippet: str, parser: str | None) -> None:
    assert parser_for_template(snippet) == parser


def test_the_embedded_template_is_hermes() -> None:
    assert parser_for_template(EMBEDDED_TEMPLATE.read_text()) == "hermes"


def test_template_from_jinja_file_or_tokenizer_config(tmp_path: Path) -> None:
    hermes = EMBEDDED_TEMPLATE.read_text()
    assert model_chat_template(_model_dir(tmp_path / "a", jinja=hermes)) == hermes
    assert model_chat_template(_model_dir(tmp_path / "b", config_template="[TOOL_CALLS]")) == "[TOOL_CALLS]"
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "<tool_call>"}]
    assert model_chat_template(_model_dir(tmp_path / "c", config_template=named)) == "<tool_call>"
    assert model_chat_template(_model_dir(tmp_path / "d")) is None


def test_setting_wins_and_none_turns_tools_off(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", jinja=EMBEDDED_TEMPLATE.read_text())
    assert choose_tool_call_parser("", str(model)) == "hermes"
    assert choose_tool_call_parser("mistral", str(model)) == "mistral"
    assert choose_tool_call_parser("none", str(model)) is None
    plain = _model_dir(tmp_path / "p", jinja="{{ messages }}")
    assert choose_tool_call_parser("", str(plain)) is None
    # A chat template file given to vLLM is the one the model is prompted with, so it decides.
    template_file = tmp_path / "tools.jinja"
    shutil.copy(EMBEDDED_TEMPLATE, template_file)
    assert choose_tool_call_parser("", str(plain), str(template_file)) == "hermes"


def test_hub_id_outside_the_cache_has_no_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert choose_tool_call_parser("", "no-such-org/no-such-model") is None


def test_base_model_given_as_a_directory_gets_its_parser(tmp_path: Path) -> None:
    """The embedded model's directory, named by path rather than by name, still serves tool calls."""
    model = _model_dir(tmp_path / "models" / "my-model", jinja=EMBEDDED_TEMPLATE.read_text())
    settings = Settings.load(engine="vllm", base_model=str(model), data_dir=tmp_path / "data", vllm_port=0)
    engine = build_vllm_engine(settings)
    assert isinstance(engine, VLLMEngine) and engine.launch is not None
    command = engine.launch.command()
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    assert command[command.index("--tool-strict-level") + 1] == "parameter"
    assert "--enable-auto-tool-choice" in command
    assert engine.served_name == "my-model"


def test_tool_strict_level_can_be_left_out(tmp_path: Path) -> None:
    """A vLLM build without `--tool-strict-level` refuses to start with it: an empty setting leaves it out."""
    model = _model_dir(tmp_path / "models" / "my-model", jinja=EMBEDDED_TEMPLATE.read_text())
    settings = Settings.load(
        engine="vllm",
        base_model=str(model),
        data_dir=tmp_path / "data",
        vllm_port=0,
        vllm_tool_strict_level="",
    )
    engine = build_vllm_engine(settings)
    assert isinstance(engine, VLLMEngine) and engine.launch is not None
    command = engine.launch.command()
    assert command[command.index("--tool-call-parser") + 1] == "hermes"
    assert "--tool-strict-level" not in command
