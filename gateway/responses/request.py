"""Translate a `POST /v1/responses` request into the chat-completions request an engine serves.

Both engines speak chat completions, so a Responses call is served and captured as the chat call it translates
to: `instructions` become a leading system message; input messages keep their role (their `input_text`,
`input_image` and `input_file` parts become `text`, `image_url` and `file` parts); an assistant message and the
`function_call` items after it become one assistant message with `tool_calls`, as the engine answered it, so a
client that sends the whole conversation back stitches onto the same episode as chat clients do;
`function_call_output` items become `tool` messages; `item_reference` items are replaced by the stored output
item they name. Function tools, `tool_choice`, `parallel_tool_calls`, `text.format`, `max_output_tokens`,
`temperature`, `top_p`, `user`, `metadata` and top logprobs map onto their chat counterparts; fields the spec
does not know are passed to the engine like unknown chat fields.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from gateway.errors import InvalidRequest
from gateway.json_schemas import check_schema
from gateway.responses.protocol import (
    CreateResponseRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputContentPart,
    InputFilePart,
    InputImagePart,
    InputMessageItem,
    InputTextPart,
    ItemReference,
    OutputTextPart,
    ReasoningInputItem,
    RefusalOutputPart,
    ResponsesFunctionTool,
    TextFormatJsonObject,
    TextFormatJsonSchema,
    ToolChoiceAllowed,
    ToolChoiceFunction,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_PATH = re.compile(r"at `\$\.?(.*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_KNOWN_FIELDS = frozenset(CreateResponseRequest.__struct_fields__)
# Chat-completions fields that would contradict what the translation sets.
_CHAT_ONLY_FIELDS = frozenset(
    {
        "messages",
        "n",
        "logprobs",
        "max_tokens",
        "max_completion_tokens",
        "response_format",
        "functions",
        "function_call",
    }
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"

InputItem = InputMessageItem | FunctionCallItem | FunctionCallOutputItem | ItemReference | ReasoningInputItem
ResolvedItem = InputMessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": InputMessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "item_reference": ItemReference,
    "reasoning": ReasoningInputItem,  # carries nothing a chat-completions engine can use: left out
}


def _invalid(exc: msgspec.ValidationError, prefix: str = "") -> InvalidRequest:
    """A 400 naming the parameter; `prefix` locates a value converted on its own (`input[3]`, `tools[0]`)."""
    message = str(exc)
    match = _PATH.search(message)
    path = match.group(1) if match else ""
    if prefix:
        path = prefix + ("" if not path or path.startswith("[") else ".") + path
        message = (message[: match.start()] if match else message + " - ") + f"at `$.{path}`"
    missing = _MISSING.search(message)
    if missing:  # the parameter is the field left out, not the object it belongs in
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return InvalidRequest(message, param=path or None, code="invalid_value")


def convert(value: Any, model: type[T], param: str) -> T:
    """`value` as `model`; a 400 naming the parameter inside `param` that is wrong."""
    try:
        return msgspec.convert(value, model)
    except msgspec.ValidationError as exc:
        raise _invalid(exc, param) from exc


def parse_request(body: Mapping[str, Any]) -> CreateResponseRequest:
    """The typed request; a wrong type or value is a 400 naming the parameter."""
    try:
        request = msgspec.convert(body, CreateResponseRequest)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from exc
    unsupported = (
        ("background", request.background, "background mode is not supported; omit `background`"),
        ("conversation", request.conversation, "conversations are not supported; use previous_response_id"),
        ("prompt", request.prompt, "prompt templates are not supported; send `instructions` and `input`"),
    )
    for param, value, message in unsupported:
        if value:
            raise InvalidRequest(message, param=param, code="unsupported_parameter")
    if not request.input:
        raise InvalidRequest("`input` must not be empty", param="input", code="invalid_value")
    return request


def extra_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """Fields the spec does not define: forwarded to the engine, as unknown chat fields are (sampling
    extensions such as vLLM's `top_k`). Chat-completions fields that the translation sets are refused."""
    extras = {k: v for k, v in body.items() if k not in _KNOWN_FIELDS}
    clashes = sorted(extras.keys() & _CHAT_ONLY_FIELDS)
    if clashes:
        raise InvalidRequest(
            f"Unknown parameter: '{clashes[0]}' is a chat-completions parameter (the Responses API takes "
            "`input`, `text.format` and `max_output_tokens`)",
            param=clashes[0],
            code="unknown_parameter",
        )
    if extras:
        log.debug("passing fields the Responses API does not define to the engine: %s", sorted(extras))
    return extras


def parse_items(raw: str | list[dict[str, Any]]) -> list[InputItem]:
    """Input items, typed. A string is one user message; a message may leave out `type`, and so may an
    item reference (an object with only an `id`)."""
    if isinstance(raw, str):
        return [InputMessageItem(role="user", content=raw)]
    items: list[InputItem] = []
    for index, item in enumerate(raw):
        kind = item.get("type")
        if kind is None:
            kind = "message" if "role" in item else "item_reference" if "id" in item else None
        model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise InvalidRequest(
                f"input items of type {kind!r} are not supported (supported: message, function_call, "
                "function_call_output, item_reference, reasoning)",
                param=f"input[{index}].type",
                code="unsupported_value",
            )
        items.append(convert(item, model, f"input[{index}]"))
    return items


def references(items: Sequence[InputItem]) -> list[tuple[int, str]]:
    """(position, id) of the stored items the input refers to."""
    return [(index, item.id) for index, item in enumerate(items) if isinstance(item, ItemReference)]


# ----------------------------------------------------------------------------- messages


def _text_part(part: InputTextPart | OutputTextPart) -> dict[str, Any]:
    return {"type": "text", "text": part.text}


def _chat_part(part: InputContentPart, param: str, *, images: bool) -> dict[str, Any]:
    if isinstance(part, InputTextPart | OutputTextPart):
        return _text_part(part)
    if isinstance(part, RefusalOutputPart):
        return {"type": "text", "text": part.refusal}
    if not images:
        raise InvalidRequest(
            "only text parts are allowed here (images and files go in user messages)",
            param=param,
            code="unsupported_value",
        )
    if isinstance(part, InputImagePart):
        if part.image_url is None:
            raise InvalidRequest(
                "images must be given by `image_url` (a URL or a data URL); file ids are not supported",
                param=param + ".image_url",
                code="unsupported_value",
            )
        detail = part.detail if part.detail in ("low", "high", "auto") else "auto"
        return {"type": "image_url", "image_url": {"url": part.image_url, "detail": detail}}
    assert isinstance(part, InputFilePart)
    if part.file_url is not None:
        raise InvalidRequest(
            "files must be given inline (`file_data`) or by `file_id`; `file_url` is not supported",
            param=param + ".file_url",
            code="unsupported_value",
        )
    file = {
        k: v
        for k, v in (("file_data", part.file_data), ("file_id", part.file_id), ("filename", part.filename))
        if v
    }
    return {"type": "file", "file": file}


def _assistant_text(content: str | list[InputContentPart], param: str) -> tuple[str | None, str | None]:
    """(content, refusal) of an assistant message sent back: its text parts joined, as the engine wrote them."""
    if isinstance(content, str):
        return content, None
    texts: list[str] = []
    refusals: list[str] = []
    for index, part in enumerate(content):
        if isinstance(part, InputTextPart | OutputTextPart):
            texts.append(part.text)
        elif isinstance(part, RefusalOutputPart):
            refusals.append(part.refusal)
        else:
            raise InvalidRequest(
                "assistant messages hold text only",
                param=f"{param}.content[{index}]",
                code="unsupported_value",
            )
    return ("".join(texts) if texts else None), ("".join(refusals) if refusals else None)


def _tool_output(item: FunctionCallOutputItem, param: str) -> str | list[dict[str, Any]]:
    if isinstance(item.output, str):
        return item.output
    parts = []
    for index, part in enumerate(item.output):
        if not isinstance(part, InputTextPart):
            raise InvalidRequest(
                "function call outputs hold text only on a chat-completions engine",
                param=f"{param}.output[{index}]",
                code="unsupported_value",
            )
        parts.append(_text_part(part))
    return parts


def to_messages(
    instructions: str | None,
    history: Sequence[Mapping[str, Any]],
    items: Sequence[InputItem],
    referenced: Mapping[str, ResolvedItem],
) -> list[dict[str, Any]]:
    """The chat messages of a call: instructions, the conversation it continues, then its input items."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    messages.extend(dict(m) for m in history)
    assistant: dict[str, Any] | None = None  # the assistant turn being assembled from output items

    def close() -> None:
        nonlocal assistant
        if assistant is not None:
            messages.append(assistant)
            assistant = None

    for index, given in enumerate(items):
        param = f"input[{index}]"
        if isinstance(given, ReasoningInputItem):
            continue
        item = referenced[given.id] if isinstance(given, ItemReference) else given
        if isinstance(item, InputMessageItem) and item.role == "assistant":
            content, refusal = _assistant_text(item.content, param)
            if assistant is None or "tool_calls" in assistant:
                close()
                assistant = {"role": "assistant", "content": None}
            if content is not None:
                assistant["content"] = (assistant["content"] or "") + content
            if refusal is not None:
                assistant["refusal"] = refusal
        elif isinstance(item, FunctionCallItem):
            if assistant is None:
                assistant = {"role": "assistant", "content": None}
            assistant.setdefault("tool_calls", []).append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
        elif isinstance(item, FunctionCallOutputItem):
            close()
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _tool_output(item, param)}
            )
        else:
            assert isinstance(item, InputMessageItem)
            close()
            images = item.role == "user"
            parts: Any = (
                item.content
                if isinstance(item.content, str)
                else [
                    _chat_part(p, f"{param}.content[{k}]", images=images) for k, p in enumerate(item.content)
                ]
            )
            messages.append({"role": item.role, "content": parts})
    close()
    return messages


# ----------------------------------------------------------------------------- tools and formats


@dataclass
class ChatTools:
    """The request's function tools (echoed in the response) and their chat form."""

    tools: list[ResponsesFunctionTool]
    chat_tools: list[dict[str, Any]]
    chat_tool_choice: str | dict[str, Any] | None


def translate_tools(request: CreateResponseRequest) -> ChatTools:
    tools: list[ResponsesFunctionTool] = []
    for index, raw in enumerate(request.tools or []):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise InvalidRequest(
                f"tools of type {kind!r} are not supported: this gateway serves function tools",
                param=f"tools[{index}].type",
                code="unsupported_value",
            )
        tool = convert(raw, ResponsesFunctionTool, f"tools[{index}]")
        if tool.parameters is not None:
            check_schema("function", tool.name, tool.parameters, f"tools[{index}].parameters")
        tools.append(tool)
    names = [tool.name for tool in tools]
    choice = request.tool_choice
    if choice == "required" and not tools:
        raise InvalidRequest("tool_choice `required` needs tools", param="tool_choice", code="invalid_value")
    chat_choice: str | dict[str, Any] | None = None
    offered = tools
    if isinstance(choice, str):
        chat_choice = choice
    elif isinstance(choice, ToolChoiceFunction):
        if choice.name not in names:
            raise InvalidRequest(
                f"tool_choice names the function {choice.name!r}, which is not among the tools",
                param="tool_choice.name",
                code="invalid_value",
            )
        chat_choice = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ToolChoiceAllowed):
        allowed = [t.get("name") for t in choice.tools if isinstance(t, dict) and t.get("type") == "function"]
        unknown = [name for name in allowed if name not in names]
        if unknown or len(allowed) != len(choice.tools):
            raise InvalidRequest(
                "tool_choice.tools must name function tools among the tools",
                param="tool_choice.tools",
                code="invalid_value",
            )
        offered = [tool for tool in tools if tool.name in allowed]
        chat_choice = choice.mode
    chat_tools = []
    for tool in offered:
        function: dict[str, Any] = {"name": tool.name}
        for key in ("description", "parameters", "strict"):
            value = getattr(tool, key)
            if value is not None:
                function[key] = value
        chat_tools.append({"type": "function", "function": function})
    return ChatTools(tools, chat_tools, chat_choice)


def response_format(request: CreateResponseRequest) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None for plain text)."""
    fmt = request.text.format if request.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        check_schema("response format", fmt.name, fmt.schema, "text.format.schema")
        schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    return None


def chat_body(
    request: CreateResponseRequest,
    messages: list[dict[str, Any]],
    tools: ChatTools,
    extras: Mapping[str, Any],
) -> dict[str, Any]:
    """The chat-completions request; translated fields win over extras of the same name."""
    body: dict[str, Any] = {**extras, "model": request.model, "messages": messages}
    if tools.chat_tools:  # without tools, `none` and `auto` mean nothing, and engines refuse them
        body["tools"] = tools.chat_tools
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
        if tools.chat_tool_choice is not None:
            body["tool_choice"] = tools.chat_tool_choice
    fmt = response_format(request)
    if fmt is not None:
        body["response_format"] = fmt
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p", "user", "metadata", "prompt_cache_key", "safety_identifier"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if LOGPROBS_INCLUDE in (request.include or ()):
        body["logprobs"] = True
        if request.top_logprobs:
            body["top_logprobs"] = request.top_logprobs
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # the usage the final event reports
    return body


# ----------------------------------------------------------------------------- stored input items


def _input_part(part: InputContentPart) -> dict[str, Any]:
    if isinstance(part, InputTextPart):
        return {"type": "input_text", "text": part.text}
    if isinstance(part, OutputTextPart):
        return {"type": "output_text", "text": part.text, "annotations": [], "logprobs": []}
    if isinstance(part, RefusalOutputPart):
        return {"type": "refusal", "refusal": part.refusal}
    if isinstance(part, InputImagePart):
        return {
            "type": "input_image",
            "image_url": part.image_url,
            "file_id": part.file_id,
            "detail": part.detail,
        }
    fields = (("file_id", part.file_id), ("filename", part.filename), ("file_data", part.file_data))
    return {"type": "input_file", **{k: v for k, v in fields if v is not None}}


def item_resources(
    items: Sequence[InputItem], referenced: Mapping[str, ResolvedItem], call_id: str
) -> list[dict[str, Any]]:
    """The input as the item resources `GET /v1/responses/{id}/input_items` lists, each with an id (the
    client's, or one made from the call id and the item's position)."""
    resources = []
    for index, given in enumerate(items):
        if isinstance(given, ReasoningInputItem):
            continue
        item = referenced[given.id] if isinstance(given, ItemReference) else given
        item_id = item.id or f"in_{call_id}_{index}"
        if isinstance(item, InputMessageItem):
            if item.role == "assistant":
                text = _assistant_text(item.content, "")[0] or ""
                content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
            elif isinstance(item.content, str):
                content = [{"type": "input_text", "text": item.content}]
            else:
                content = [_input_part(p) for p in item.content]
            resources.append(
                {
                    "id": item_id,
                    "type": "message",
                    "role": item.role,
                    "content": content,
                    "status": "completed",
                }
            )
        elif isinstance(item, FunctionCallItem):
            resources.append(
                {
                    "id": item_id,
                    "type": "function_call",
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        else:
            output = item.output if isinstance(item.output, str) else [_input_part(p) for p in item.output]
            resources.append(
                {
                    "id": item_id,
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": output,
                    "status": "completed",
                }
            )
    return resources
