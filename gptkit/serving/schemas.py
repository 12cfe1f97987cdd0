"""The OpenAI request bodies, declared as pydantic models: what each field may hold, its default, its range.

    body = parse(CompletionRequest, json_object)       # a RequestError(message, param, code) if it is wrong

`CompletionRequest` is POST /v1/completions' body, `ChatRequest` POST /v1/chat/completions'. Both follow
OpenAI's API reference; `top_k` and `skip_special_tokens` are extensions, under vLLM's names. A
field sent as null is as if it were left out (clients often send their defaults explicitly). What a model
cannot say alone stays with the routes: whether a token id is in the vocabulary, whether a prompt fits the
context, how many replies the server can take at once.

Three kinds of fields besides the ones served:
    unknown        a 400 naming it (a typo is not silently dropped)
    unsupported    OpenAI options this server does not implement (`Off`): accepted at the values that mean
                   "not used", a 400 with code "unsupported_parameter" at any other
    harmless       accepted and ignored: they change nothing in the reply (user, metadata, ...)

`parse` turns pydantic's errors into one line that names the offending field (`param`, as OpenAI's errors
do): unknown fields first, then unsupported ones, then the first other error.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

INT64 = 2**63
MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 1000  # each; holding back a stop string's beginnings costs time quadratic in its length
MAX_LOGPROBS = 5  # /v1/completions' logprobs, as OpenAI
MAX_TOP_LOGPROBS = 20  # /v1/chat/completions' top_logprobs, as OpenAI


class RequestError(ValueError):
    """A request body that is not what the API takes: the message, the field it is about, an error code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# ----------------------------------------------------------------------------- value types


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value  # 16.0 is 16 to JavaScript


Integer = Annotated[int, BeforeValidator(_integral), Strict()]  # not a boolean, a string or 1.5
Number = Annotated[float, Strict(), AllowInfNan(False)]  # an integer or a finite float, not a boolean
TokenId = Annotated[Integer, Field(ge=0)]


def _shaped(shape: str) -> WrapValidator:
    """One error for a field of several possible shapes (pydantic would report each alternative): the field
    `must be` `shape`."""

    def validate(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("shape", shape) from None

    return WrapValidator(validate)


def Off(*unused: Any) -> Any:  # noqa: N802 (a type, spelled like one)
    """An OpenAI option this server does not implement, accepted only at the values that mean "not used" (and
    null, {} and []): anything else would silently get less than it asked for."""

    def check(value: Any) -> Any:
        if value is None or value == {} or value == [] or any(
                value == u and isinstance(value, bool) == isinstance(u, bool) for u in unused):
            return value
        raise PydanticCustomError("unsupported", "unsupported")

    return Annotated[Any, AfterValidator(check)]


def _fail(param: str, message: str) -> PydanticCustomError:
    """An error found by comparing fields: it names `param` itself (its location would be the whole body)."""
    return PydanticCustomError("request", message, {"param": param})


Prompt = Annotated[
    StrictStr | Annotated[list[StrictStr], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
    _shaped("a string, an array of strings, an array of token ids, or an array of arrays of token ids (not "
            "empty)"),
]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Annotated[
    StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)],
    _shaped(f"a non-empty string or an array of at most {MAX_STOPS} of them, each at most {MAX_STOP_CHARS} "
            f"characters"),
]
LogitBias = Annotated[
    dict[Annotated[StrictStr, Field(pattern=r"^[0-9]{1,19}$")], Annotated[Number, Field(ge=-100, le=100)]],
    _shaped('an object mapping token ids (as strings) to biases in [-100, 100], e.g. {"50256": -100}'),
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False  # a last chunk (no choices) with the usage counts


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    """One message of a conversation; other fields of OpenAI's messages (name, ...) are ignored."""

    role: Literal["system", "developer", "user", "assistant"]  # "developer" is the newer name of "system"
    content: Annotated[StrictStr | list[TextPart], _shaped(
        'a string or an array of text parts ({"type": "text", "text": ...}); only text is supported')]

    def plain(self) -> dict[str, str]:
        """{"role", "content"} with a string content, as gptkit/chat.py's template takes it."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


# ----------------------------------------------------------------------------- the request bodies


class _Request(BaseModel):
    """What both routes take."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None  # left out: the one model served
    temperature: Number = Field(1.0, ge=0, le=2)  # 0: greedy
    top_p: Number = Field(1.0, ge=0, le=1)  # 0: the likeliest token only (greedy)
    top_k: Integer = Field(0, ge=-1)  # extension: draw from the k likeliest tokens only; 0 or -1: no limit
    frequency_penalty: Number = Field(0.0, ge=-2, le=2)  # minus this times a token's count in the reply so far
    presence_penalty: Number = Field(0.0, ge=-2, le=2)  # minus this once a token is in the reply
    logit_bias: LogitBias = Field(default_factory=dict)  # added to the logits; -100 bans the token
    stop: Stop = Field(default_factory=list)  # text that ends the reply (not returned)
    seed: Integer | None = Field(None, ge=-INT64, le=INT64 - 1)
    n: Integer = Field(1, ge=1)  # replies per prompt
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: StrictBool = True  # extension: False writes special tokens in the text, by name
    # Accepted and ignored: they change nothing in the reply.
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise _fail("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt continued."""

    prompt: Prompt
    # 0 only with echo: the reply is the prompt and (with logprobs) its tokens' log-probabilities, a score
    max_tokens: Integer | None = Field(None, ge=0, le=INT64 - 1)  # None: 16, as OpenAI
    echo: StrictBool = False  # the reply starts with the prompt
    logprobs: Integer | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's, and the k likeliest tokens'
    best_of: Off(1) = None
    suffix: Off("") = None

    @model_validator(mode="after")
    def _check_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise _fail("max_tokens", "max_tokens must be at least 1 (0 only with echo, to score the prompt)")
        return self


class ChatRequest(_Request):
    """POST /v1/chat/completions: the assistant's next message in a conversation."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Integer | None = Field(None, ge=1, le=INT64 - 1)  # None: the rest of the context
    max_tokens: Integer | None = Field(None, ge=1, le=INT64 - 1)  # the older name of max_completion_tokens
    logprobs: StrictBool = False  # each token's log-probability in the reply
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and the k likeliest tokens'
    tools: Off() = None
    tool_choice: Off("none", "auto") = None
    functions: Off() = None
    function_call: Off("none", "auto") = None
    response_format: Off({"type": "text"}) = None
    modalities: Off(["text"]) = None
    audio: Off() = None
    prediction: Off() = None
    reasoning_effort: Off() = None
    web_search_options: Off() = None

    @model_validator(mode="after")
    def _check_pairs(self):
        new, old = self.max_completion_tokens, self.max_tokens
        if new is not None and old is not None and new != old:
            raise _fail("max_completion_tokens", f"max_completion_tokens ({new}) and max_tokens ({old}) "
                                                 f"disagree; give one of them")
        if self.top_logprobs and not self.logprobs:
            raise _fail("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def reply_tokens(self) -> tuple[int | None, str]:
        """The reply's max tokens as asked, and the field that asked."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's extension): a prompt's token ids, or a conversation's as the chat route renders
    it (ending with the assistant's marker, where the reply starts)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[Message], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _check_one(self):
        if (self.prompt is None) == (self.messages is None):
            raise _fail("prompt", "give either prompt or messages")
        return self


# ----------------------------------------------------------------------------- parsing, and its errors


def parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """`body` as a `model`, or a RequestError saying in one line what is wrong with it."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _request_error(e.errors(include_url=False)) from None


def _request_error(errors: list[dict[str, Any]]) -> RequestError:
    unknown = sorted({str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1})
    if unknown:
        return RequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    unsupported = sorted({str(e["loc"][0]) for e in errors if e["type"] == "unsupported"})
    if unsupported:
        them = "it" if len(unsupported) == 1 else "them"
        return RequestError(f"this server does not support {', '.join(unsupported)} (leave {them} out, or at "
                            f"the default)", unsupported[0], code="unsupported_parameter")
    error = errors[0]
    param = (error.get("ctx") or {}).get("param") or (str(error["loc"][0]) if error["loc"] else None)
    return RequestError(_describe(error), param)


_TYPES = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
          "finite_number": "a finite number", "bool_type": "a boolean", "string_type": "a string",
          "list_type": "an array", "dict_type": "an object", "model_type": "an object",
          "model_attributes_type": "an object"}
_BOUNDS = {"greater_than_equal": ("at least", "ge"), "less_than_equal": ("at most", "le"),
           "greater_than": ("more than", "gt"), "less_than": ("less than", "lt")}


def _describe(error: dict[str, Any]) -> str:
    kind, value = error["type"], error.get("input")
    where = _where(error["loc"])
    if kind == "request":
        return error["msg"]
    if kind == "shape":
        return f"{where} must be {error['msg']}"
    if kind == "too_short":
        return f"{where} must not be empty"
    if kind == "missing":
        return f"{where} is required"
    if kind in _TYPES:
        return f"{where} must be {_TYPES[kind]}, got {_type_name(value)}"
    if kind in _BOUNDS:
        words, key = _BOUNDS[kind]
        bound = error["ctx"][key]
        return f"{where} must be {words} {int(bound) if float(bound).is_integer() else bound}, got {value}"
    if kind == "extra_forbidden":
        return f"unrecognized argument {where}"
    if kind == "literal_error":
        return f"{where} must be {error['msg'].removeprefix('Input should be ')}, got {value!r}"
    return f"{where}: {error['msg']}"


def _where(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "the request body"


def _type_name(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):  # a JSON number past a float's range: 1e999
        return f"{'' if value > 0 else '-'}Infinity (a number beyond a float's range)"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
