"""The request bodies the server takes (FastAPI publishes them as its OpenAPI schema).

Every field of the OpenAI API is either honoured, accepted because it cannot change the output (`user`,
`metadata`, ...), or refused with a 400 that names it; a field nobody declared is refused too. Nothing is
dropped silently: a client that asks for tools, images or several choices learns that this server has none.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

from ..sampling import SamplingParams


class ApiError(Exception):
    """An answer other than 200, in the OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None):
        self.status, self.message, self.param = status, message, param


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        raise ValueError(f"contains an unpaired surrogate (\\u{ord(bad):04x} at character {error.start}): not valid Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
StopString = Annotated[Text, Field(min_length=1)]
INT64_MAX = 2**63 - 1  # ints past it overflow torch and numpy: refused by name


def _a_number(value):
    if isinstance(value, (str, bool)):
        raise ValueError(f"must be a JSON number, not {'a boolean' if isinstance(value, bool) else 'a string'}")
    return value


# A JSON string or boolean is no number ("temperature": "0" is refused by name, not coerced); 7.0 is the integer 7,
# as JSON Schema (and the published OpenAPI schema) has it.
Int = Annotated[int, BeforeValidator(_a_number)]
Float = Annotated[float, BeforeValidator(_a_number)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: StrictBool = False


class SamplingFields(Strict):
    model: Text | None = None
    max_tokens: Int | None = Field(None, gt=0, le=INT64_MAX)
    temperature: Float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=0, le=INT64_MAX)  # not OpenAI; as in vLLM (0: off)
    seed: Int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: StopString | list[StopString] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(1, le=INT64_MAX)
    # accepted: they change nothing in what is generated
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # refused unless neutral (see `refuse_unsupported`)
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    logit_bias: dict[str, float] | None = None

    # field -> (the neutral values clients send for a feature they do not use, why any other value is refused)
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        "n": ((None, 1), "only one choice per request is supported (n=1)"),
        "frequency_penalty": ((None, 0), "penalties are not supported"),
        "presence_penalty": ((None, 0), "penalties are not supported"),
        "logit_bias": ((None, {}), "logit_bias is not supported"),
    }

    def refuse_unsupported(self) -> None:
        """Raise ApiError(400) naming the first field that asks for something this server does not do."""
        for name, (neutral, why) in self.UNSUPPORTED.items():
            if getattr(self, name) not in neutral:
                raise ApiError(400, f"{name}: {why}", name)

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,  # the OpenAI default
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
        )

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def top_logprobs_wanted(self) -> int | None:
        """How many top tokens to list beside each token's log-probability (None: no log-probabilities)."""
        return None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text]
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: StrictBool | None = None
    best_of: Int | None = Field(None, le=INT64_MAX)
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SamplingFields.UNSUPPORTED,
        "echo": ((None, False), "echo is not supported"),
        "best_of": ((None, 1), "best_of is not supported (one choice per request)"),
        "suffix": ((None, ""), "suffix (insertion) is not supported"),
    }

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class OtherPart(BaseModel):
    """A content part this server cannot read: refused by name."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


ContentPart = Annotated[TextPart | OtherPart, Field(discriminator="type")]


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    refusal: str | None = None

    def text(self, where: str) -> str:
        """The message's text; ApiError(400) for what it cannot be (tool turns, images, ...)."""
        if self.role == "tool" or self.tool_call_id is not None:
            raise ApiError(400, f"{where}: tool messages are not supported (this server has no tool calling)", where)
        if self.tool_calls or self.function_call is not None:
            raise ApiError(400, f"{where}.tool_calls: tool calls are not supported (this server has no tool calling)", where)
        if not isinstance(self.content, list):
            return self.content or ""  # an empty or null content is an empty turn (OpenAI takes those)
        for i, part in enumerate(self.content):
            if isinstance(part, OtherPart):
                raise ApiError(400, f"{where}.content[{i}]: {part.type} content is not supported (text only)", where)
        return "".join(part.text for part in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = Field(None, gt=0, le=INT64_MAX)
    logprobs: StrictBool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None

    NO_TOOLS: ClassVar[str] = "this server has no tool calling"
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        **SamplingFields.UNSUPPORTED,
        "tools": ((None, []), f"tools are not supported ({NO_TOOLS})"),
        "functions": ((None, []), f"functions are not supported ({NO_TOOLS})"),
        "tool_choice": ((None, "none"), f"tool_choice is not supported ({NO_TOOLS})"),
        "function_call": ((None, "none"), f"function_call is not supported ({NO_TOOLS})"),
    }

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.response_format and self.response_format.get("type") != "text":
            raise ApiError(400, "response_format: only {'type': 'text'} is supported (no JSON mode or schemas)", "response_format")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs=true", "top_logprobs")

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
