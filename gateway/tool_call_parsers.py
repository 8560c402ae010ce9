"""Which vLLM tool-call parser fits a base model: read from the model's chat template, or set by the operator.

vLLM turns a model's tool-call text into `tool_calls` only with a parser that knows the model's format, and the
format is the one the chat template teaches the model (`<tool_call>` blocks for Hermes-style templates,
`[TOOL_CALLS]` for Mistral, ...). Looking at the template, wherever the base model comes from (an embedded name,
a directory, a hub id already in the local cache), keeps tools working without a setting per model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

DISABLED = "none"
"""`KAIZEN_VLLM_TOOL_CALL_PARSER=none`: serve without tool calling even if the template has a format."""

# Markers of a template's tool-call format and the vLLM parser for it, most specific first: Qwen3-Coder's XML
# calls also sit inside `<tool_call>` blocks.
_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<tool_call>", "<function="), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>",), "llama3_json"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v3"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("<|tool_call_start|>",), "lfm2"),
    (("<|tool_call|>",), "granite"),
    (("<tool_calls>",), "jamba"),
    (("<start_function_call>",), "functiongemma"),
    (("functools[",), "phi4_mini_json"),
)


def parser_for_template(template: str) -> str | None:
    """The parser whose markers the template contains, or None when it shows no tool-call format."""
    for markers, parser in _MARKERS:
        if all(marker in template for marker in markers):
            return parser
    return None


def model_chat_template(model_dir: Path) -> str | None:
    """The chat template saved with a Hugging Face model directory: `chat_template.jinja` (transformers 4.5x
    and later), else `tokenizer_config.json`'s `chat_template` (a string, or named templates, where
    `tool_use` is the one for requests with tools)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s: %s", config_path, exc)
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use") or named.get("default")
    return template if isinstance(template, str) else None


def cached_model_dir(model_id: str) -> Path | None:
    """The local snapshot of a hub model id, if the hub cache already holds its tokenizer files (no network)."""
    from huggingface_hub import try_to_load_from_cache

    for name in ("chat_template.jinja", "tokenizer_config.json"):
        found = try_to_load_from_cache(model_id, name)
        if isinstance(found, str):
            return Path(found).parent
    return None


def choose_tool_call_parser(configured: str, model: str, chat_template_file: str = "") -> str | None:
    """The parser vLLM starts with: the configured one (`none` turns tool calling off), else the one the chat
    template in use shows (the configured template file, else the model's own), else none (with a warning,
    since tool calls would then come back as text)."""
    if configured:
        return None if configured == DISABLED else configured
    template: str | None = None
    if chat_template_file:
        template_path = Path(chat_template_file).expanduser()
        template = (
            template_path.read_text(encoding="utf-8") if template_path.is_file() else chat_template_file
        )
    else:
        local = Path(model).expanduser()
        model_dir = local if local.is_dir() else cached_model_dir(model)
        template = model_chat_template(model_dir) if model_dir is not None else None
    parser = parser_for_template(template) if template else None
    if parser is None:
        log.warning(
            "no tool-call format found in the chat template of %s: tool calls will come back as text; "
            "set KAIZEN_VLLM_TOOL_CALL_PARSER to the vLLM parser for this model",
            model,
        )
    else:
        log.info("tool calls of %s are parsed with vLLM's %s parser (from its chat template)", model, parser)
    return parser
