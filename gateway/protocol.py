"""Typed models of the OpenAI chat completions, completions, embeddings and models endpoints and of the error
body, mirroring the spec, used everywhere in the gateway (the Responses API's are `gateway.responses.protocol`).

Requests are validated with these models (msgspec: fast, with precise error paths); responses and stream
chunks are *rebuilt* from these models so whatever an engine returns, the client gets spec-conformant output
(no `null` where the spec forbids it, `refusal` present in logprobs, string error codes).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

# ----------------------------------------------------------------------------- request


class TextPart(Struct, tag_field="type", tag="text"):
    """Extra fields (`cache_control`, `prompt_cache_breakpoint`, ...) are the engine's business: forwarded."""

    text: str


class ImageUrl(Struct):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(Struct, tag_field="type", tag="image_url"):
    image_url: ImageUrl


class AudioPart(Struct, tag_field="type", tag="input_audio"):
    input_audio: dict[str, Any]


class FilePart(Struct, tag_field="type", tag="file"):
    file: dict[str, Any]


class RefusalPart(Struct, tag_field="type", tag="refusal"):
    refusal: str


class TextOnlyPart(Struct):
    """A part of a message that holds text alone (system, developer, tool). `type` is a field here, not a tag:
    msgspec requires a tag only inside a union, and the spec requires it always."""

    type: Literal["text"]
    text: str


# The spec's content arrays have at least one part.
UserContent = str | Annotated[list[TextPart | ImagePart | AudioPart | FilePart], Meta(min_length=1)]
TextContent = str | Annotated[list[TextOnlyPart], Meta(min_length=1)]


class FunctionCall(Struct):
    name: str
    arguments: str


class ToolCall(Struct):
    id: str
    type: Literal["function"]
    function: FunctionCall


class SystemMessage(Struct, tag_field="role", tag="system"):
    content: TextContent
    name: str | None = None


class DeveloperMessage(Struct, tag_field="role", tag="developer"):
    content: TextContent
    name: str | None = None


class UserMessage(Struct, tag_field="role", tag="user"):
    content: UserContent
    name: str | None = None


class AssistantMessage(Struct, tag_field="role", tag="assistant"):
    content: str | list[TextPart | RefusalPart] | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    name: str | None = None
    function_call: FunctionCall | None = None

    def __post_init__(self) -> None:
        # The spec requires content unless the message calls a tool; a refusal echoed back is let through.
        if (
            self.content is None
            and not self.tool_calls
            and self.function_call is None
            and self.refusal is None
        ):
            raise ValueError("an assistant message needs content or tool_calls")


class ToolMessage(Struct, tag_field="role", tag="tool"):
    content: TextContent
    tool_call_id: str


class FunctionMessage(Struct, tag_field="role", tag="function"):
    content: str | None
    name: str


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage


# The names of functions and response formats: letters, digits, underscores and dashes, at most 64.
Name = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class FunctionDefinition(Struct):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(Struct, tag_field="type", tag="function"):
    """`ChatCompletionTool`."""

    function: FunctionDefinition


class CustomTextFormat(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """A custom tool's unconstrained text input."""


class Grammar(Struct):
    definition: str
    syntax: Literal["lark", "regex"]


class GrammarFormat(Struct, tag_field="type", tag="grammar"):
    grammar: Grammar


class CustomToolDefinition(Struct):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    format: CustomTextFormat | GrammarFormat | None = None


class CustomTool(Struct, tag_field="type", tag="custom"):
    """`CustomToolChatCompletions`: free-form input instead of JSON arguments (forwarded; vLLM refuses it)."""

    custom: CustomToolDefinition


Tool = FunctionTool | CustomTool


def tool_name(tool: Tool) -> str:
    return tool.function.name if isinstance(tool, FunctionTool) else tool.custom.name


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct, tag_field="type", tag="function"):
    """`ChatCompletionNamedToolChoice`."""

    function: NamedFunction


class NamedCustomToolChoice(Struct, tag_field="type", tag="custom"):
    """`ChatCompletionNamedToolChoiceCustom`."""

    custom: NamedFunction


class AllowedTools(Struct):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class AllowedToolsChoice(Struct, tag_field="type", tag="allowed_tools"):
    """`ChatCompletionAllowedToolsChoice`: the model may only call these of the request's tools."""

    allowed_tools: AllowedTools


ToolChoice = (
    Literal["none", "auto", "required"] | AllowedToolsChoice | NamedToolChoice | NamedCustomToolChoice
)


class StreamOptions(Struct):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ResponseFormatText(Struct, tag_field="type", tag="text"):
    """`ResponseFormatText`."""


class ResponseFormatJsonObject(Struct, tag_field="type", tag="json_object"):
    """`ResponseFormatJsonObject`."""


class JsonSchema(Struct):
    """`ResponseFormatJsonSchema.json_schema`: typed here so a malformed one is the client's 400, not a failed
    call the engine refused."""

    name: Name
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormatJsonSchema(Struct, tag_field="type", tag="json_schema"):
    """`ResponseFormatJsonSchema`."""

    json_schema: JsonSchema


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
# Engines keep token counts in 32-bit and seeds in 64-bit integers: larger numbers are refused here, as the
# client's error, instead of being sent on (and recorded as a failed call) or overflowing the engine.
TokenCount = Annotated[int, Meta(ge=1, le=2**31 - 1)]
SEED_MAX = 2**63 - 1
Seed = Annotated[int, Meta(ge=-SEED_MAX - 1, le=SEED_MAX)]


# Keys are token ids, as the spec has them; values may be fractional, as engines accept.
LogitBias = dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Annotated[float, Meta(ge=-100, le=100)]]


class PredictionContent(Struct):
    """`PredictionContent`: the predicted output; engines without predicted outputs ignore it."""

    type: Literal["content"]
    content: TextContent


class ChatCompletionRequest(Struct, kw_only=True):
    """`CreateChatCompletionRequest`: the fields Kaizen understands. Unknown fields are ignored here and
    forwarded to the engine untouched (the gateway keeps the raw body for that)."""

    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[Message], Meta(min_length=1)]
    n: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    max_tokens: TokenCount | None = None
    reasoning_effort: ReasoningEffort | None = None
    max_completion_tokens: TokenCount | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    seed: Seed | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    logit_bias: LogitBias | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: PredictionContent | None = None


# A text, or a list of texts, of token ids, or of token-id lists (msgspec allows one array type per union, so
# the list's items are checked to be of one kind by `uniform_items`).
Prompt = str | Annotated[list[str | int | Annotated[list[int], Meta(min_length=1)]], Meta(min_length=1)]


class CompletionRequest(Struct, kw_only=True):
    """`CreateCompletionRequest` (legacy text completions), the fields Kaizen checks; the rest is forwarded."""

    model: Annotated[str, Meta(min_length=1)]
    prompt: Prompt
    best_of: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    logit_bias: LogitBias | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    max_tokens: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # not in the spec for completions; Kaizen's episode and group keys


EmbeddingInput = (
    Annotated[str, Meta(min_length=1)]
    | Annotated[
        list[Annotated[str, Meta(min_length=1)] | int | Annotated[list[int], Meta(min_length=1)]],
        Meta(min_length=1, max_length=2048),
    ]
)


def uniform_items(value: str | list[Any]) -> bool:
    """A prompt or embedding input list holds one kind of item: texts, token ids, or token-id lists."""
    if isinstance(value, str):
        return True
    kinds = {type(item) for item in value}
    return len(kinds) == 1


class EmbeddingRequest(Struct, kw_only=True):
    """`CreateEmbeddingRequest`."""

    input: EmbeddingInput
    model: Annotated[str, Meta(min_length=1)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None
    user: str | None = None


# ----------------------------------------------------------------------------- response
# Optional-but-not-nullable spec fields default to UNSET, which msgspec leaves out of the JSON entirely.


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class ResponseFunction(Struct):
    name: str
    arguments: str


class ResponseToolCall(Struct):
    id: str
    function: ResponseFunction
    type: Literal["function"] = "function"


class ResponseMessage(Struct):
    content: str | None
    refusal: str | None
    role: Literal["assistant"] = "assistant"
    tool_calls: list[ResponseToolCall] | UnsetType = UNSET
    # Not in the spec: a reasoning parser's output, under the name the engine used (vLLM `reasoning`; DeepSeek's
    # API and older vLLM `reasoning_content`).
    reasoning: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class Choice(Struct):
    index: int
    message: ResponseMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | UnsetType = UNSET
    completion_tokens_details: dict[str, int] | UnsetType = UNSET


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET


class ToolCallChunkFunction(Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallChunk(Struct):
    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: ToolCallChunkFunction | UnsetType = UNSET


class Delta(Struct):
    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    refusal: str | UnsetType | None = UNSET
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET  # not in the spec, as on `ResponseMessage`
    reasoning_content: str | UnsetType = UNSET


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: FinishReason | None
    logprobs: ChoiceLogprobs | UnsetType | None = UNSET


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: Usage | UnsetType | None = UNSET
    system_fingerprint: str | UnsetType = UNSET


class CompletionLogprobs(Struct):
    text_offset: list[int] | UnsetType = UNSET
    token_logprobs: list[float | None] | UnsetType = UNSET
    tokens: list[str] | UnsetType = UNSET
    top_logprobs: list[dict[str, float] | None] | UnsetType = UNSET


class CompletionChoice(Struct):
    finish_reason: Literal["stop", "length", "content_filter"] | None
    index: int
    logprobs: CompletionLogprobs | None
    text: str


class TextCompletion(Struct):
    """`CreateCompletionResponse`; stream chunks share the shape (`finish_reason` null until the last)."""

    id: str
    choices: list[CompletionChoice]
    created: int
    model: str
    object: Literal["text_completion"] = "text_completion"
    usage: Usage | UnsetType = UNSET
    system_fingerprint: str | UnsetType = UNSET


class Embedding(Struct):
    index: int
    embedding: list[float] | str
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    """`CreateEmbeddingResponse`."""

    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorBody
