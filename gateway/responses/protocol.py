"""Typed models of the OpenAI Responses API, mirroring the spec (fields in the spec's order).

Requests are validated with these models and responses and stream events are built from them, as
`gateway.protocol` does for chat completions; the translation between the two lives beside this module.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType, field

from gateway.protocol import Name, Probability

# ----------------------------------------------------------------------------- request
# `CreateResponse` and the parts of it the gateway translates into a chat completion. Input items are told
# apart by hand (`gateway.responses.request`): the spec lets a message and an item reference leave out `type`.


class InputTextPart(Struct, tag_field="type", tag="input_text"):
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputImagePart(Struct, tag_field="type", tag="input_image"):
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] = "auto"


class InputFilePart(Struct, tag_field="type", tag="input_file"):
    file_id: str | None = None
    filename: str | None = None
    file_data: str | None = None
    file_url: str | None = None


class OutputTextPart(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []


class RefusalOutputPart(Struct, tag_field="type", tag="refusal"):
    refusal: str


InputContentPart = InputTextPart | InputImagePart | InputFilePart | OutputTextPart | RefusalOutputPart
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputMessageItem(Struct, kw_only=True):
    """`EasyInputMessage` and `InputMessage`, and an `OutputMessage` the client sends back (role assistant)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContentPart]
    phase: Literal["commentary", "final_answer"] | None = None
    type: Literal["message"] = "message"
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(Struct, kw_only=True):
    """`FunctionToolCall`: a call the model made, sent back with the conversation."""

    id: str | None = None
    type: Literal["function_call"] = "function_call"
    call_id: Annotated[str, Meta(min_length=1)]
    namespace: str | None = None
    name: Annotated[str, Meta(min_length=1)]
    arguments: str
    status: ItemStatus | None = None


class FunctionCallOutputItem(Struct, kw_only=True):
    """`FunctionCallOutputItemParam`: the result of running a function call."""

    id: str | None = None
    call_id: Annotated[str, Meta(min_length=1, max_length=64)]
    type: Literal["function_call_output"] = "function_call_output"
    output: str | list[InputTextPart | InputImagePart | InputFilePart]
    status: ItemStatus | None = None


class ReasoningInputItem(Struct, kw_only=True):
    """`ReasoningItem` sent back: accepted and left out of the conversation (no chat equivalent)."""

    type: Literal["reasoning"] = "reasoning"
    id: str | None = None


class ItemReference(Struct, kw_only=True):
    """`ItemReferenceParam`: an item of a stored response, named by its id."""

    type: Literal["item_reference"] | None = "item_reference"
    id: Annotated[str, Meta(min_length=1)]


class ResponsesFunctionTool(Struct, kw_only=True):
    """`FunctionTool`; its `parameters` and `strict` are echoed in the response (null when not given)."""

    type: Literal["function"] = "function"
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(Struct, tag_field="type", tag="function"):
    name: Annotated[str, Meta(min_length=1)]


class ToolChoiceAllowed(Struct, tag_field="type", tag="allowed_tools"):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


ResponsesToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceAllowed


class TextFormatText(Struct, tag_field="type", tag="text"):
    pass


class TextFormatJsonSchema(Struct, tag_field="type", tag="json_schema", kw_only=True):
    description: str | None = None
    name: Name
    schema: dict[str, Any]
    strict: bool | None = None


class TextFormatJsonObject(Struct, tag_field="type", tag="json_object"):
    pass


TextFormat = TextFormatText | TextFormatJsonSchema | TextFormatJsonObject


class ResponseTextParam(Struct):
    format: TextFormat = field(default_factory=TextFormatText)
    verbosity: Literal["low", "medium", "high"] | None = None


IncludeValue = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class CreateResponseRequest(Struct, kw_only=True):
    """`CreateResponse`, in the spec's order. `input` stays raw here: its items are converted one by one.
    Fields the spec lists that have no effect on a chat-completions engine are accepted and echoed."""

    metadata: dict[str, Annotated[str, Meta(max_length=512)]] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    user: str | None = None
    safety_identifier: Annotated[str, Meta(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    previous_response_id: Annotated[str, Meta(min_length=1)] | None = None
    model: Annotated[str, Meta(min_length=1)]
    background: bool | None = None
    max_tool_calls: Annotated[int, Meta(ge=0)] | None = None
    text: ResponseTextParam | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ResponsesToolChoice | None = None
    prompt: dict[str, Any] | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    input: str | list[dict[str, Any]]
    include: list[IncludeValue] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    instructions: str | None = None
    moderation: dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    max_output_tokens: Annotated[int, Meta(ge=16, le=2**31 - 1)] | None = None


# ----------------------------------------------------------------------------- response


class TopLogProb(Struct):
    token: str
    logprob: float
    bytes: list[int]


class LogProb(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogProb]


class ResponseOutputText(Struct, tag_field="type", tag="output_text"):
    """`OutputTextContent`."""

    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[LogProb]


class ResponseRefusal(Struct, tag_field="type", tag="refusal"):
    refusal: str


class ResponseOutputMessage(Struct, tag_field="type", tag="message", kw_only=True):
    """`OutputMessage`."""

    id: str
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText | ResponseRefusal]
    status: ItemStatus


class ResponseFunctionCall(Struct, tag_field="type", tag="function_call", kw_only=True):
    """`FunctionToolCall`, as output."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = ResponseOutputMessage | ResponseFunctionCall


class InputTokensDetails(Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


ResponseErrorCode = Literal["server_error", "rate_limit_exceeded", "invalid_prompt"]


class ResponseError(Struct):
    code: ResponseErrorCode
    message: str


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class Response(Struct, kw_only=True):
    """`Response`, in the spec's order (ModelResponseProperties, ResponseProperties, then its own fields)."""

    metadata: dict[str, str] | None
    top_logprobs: int | UnsetType = UNSET
    temperature: float | None
    top_p: float | None
    user: str | UnsetType = UNSET
    safety_identifier: str | UnsetType = UNSET
    prompt_cache_key: str | UnsetType = UNSET
    previous_response_id: str | None = None
    model: str
    background: bool = False
    max_tool_calls: int | None = None
    text: ResponseTextParam
    tools: list[ResponsesFunctionTool]
    tool_choice: ResponsesToolChoice
    truncation: Literal["auto", "disabled"] = "disabled"
    id: str
    object: Literal["response"] = "response"
    status: ResponseStatus
    created_at: int
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    output: list[OutputItem]
    reasoning: dict[str, Any] | None = None
    instructions: str | None
    usage: ResponseUsage | UnsetType = UNSET
    parallel_tool_calls: bool
    max_output_tokens: int | None = None


class ResponseDeleted(Struct):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class ResponseItemList(Struct, kw_only=True):
    """`ResponseItemList`: the input items of a stored response (stored as the item resources they are)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    has_more: bool
    first_id: str
    last_id: str


# Stream events (`ResponseStreamEvent` variants), each with its `sequence_number`.


class ResponseTopLogprob(Struct):
    token: str
    logprob: float


class ResponseLogProb(Struct):
    """Per-token logprob of a text delta (`ResponseLogProb`: no byte values, unlike `LogProb`)."""

    token: str
    logprob: float
    top_logprobs: list[ResponseTopLogprob]


class ResponseCreatedEvent(Struct, tag_field="type", tag="response.created"):
    response: Response
    sequence_number: int


class ResponseInProgressEvent(Struct, tag_field="type", tag="response.in_progress"):
    response: Response
    sequence_number: int


class ResponseCompletedEvent(Struct, tag_field="type", tag="response.completed"):
    response: Response
    sequence_number: int


class ResponseIncompleteEvent(Struct, tag_field="type", tag="response.incomplete"):
    response: Response
    sequence_number: int


class ResponseFailedEvent(Struct, tag_field="type", tag="response.failed"):
    sequence_number: int
    response: Response


class ResponseOutputItemAddedEvent(Struct, tag_field="type", tag="response.output_item.added"):
    output_index: int
    sequence_number: int
    item: OutputItem


class ResponseOutputItemDoneEvent(Struct, tag_field="type", tag="response.output_item.done"):
    output_index: int
    sequence_number: int
    item: OutputItem


class ResponseContentPartAddedEvent(Struct, tag_field="type", tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: ResponseOutputText | ResponseRefusal
    sequence_number: int


class ResponseContentPartDoneEvent(Struct, tag_field="type", tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    sequence_number: int
    part: ResponseOutputText | ResponseRefusal


class ResponseTextDeltaEvent(Struct, tag_field="type", tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    sequence_number: int
    logprobs: list[ResponseLogProb]


class ResponseTextDoneEvent(Struct, tag_field="type", tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    sequence_number: int
    logprobs: list[ResponseLogProb]


class ResponseRefusalDeltaEvent(Struct, tag_field="type", tag="response.refusal.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    sequence_number: int


class ResponseRefusalDoneEvent(Struct, tag_field="type", tag="response.refusal.done"):
    item_id: str
    output_index: int
    content_index: int
    refusal: str
    sequence_number: int


class ResponseFunctionCallArgumentsDeltaEvent(
    Struct, tag_field="type", tag="response.function_call_arguments.delta"
):
    item_id: str
    output_index: int
    sequence_number: int
    delta: str


class ResponseFunctionCallArgumentsDoneEvent(
    Struct, tag_field="type", tag="response.function_call_arguments.done"
):
    item_id: str
    name: str
    output_index: int
    sequence_number: int
    arguments: str


ResponseStreamEvent = (
    ResponseCreatedEvent
    | ResponseInProgressEvent
    | ResponseCompletedEvent
    | ResponseIncompleteEvent
    | ResponseFailedEvent
    | ResponseOutputItemAddedEvent
    | ResponseOutputItemDoneEvent
    | ResponseContentPartAddedEvent
    | ResponseContentPartDoneEvent
    | ResponseTextDeltaEvent
    | ResponseTextDoneEvent
    | ResponseRefusalDeltaEvent
    | ResponseRefusalDoneEvent
    | ResponseFunctionCallArgumentsDeltaEvent
    | ResponseFunctionCallArgumentsDoneEvent
)
