"""The request shapes of ``POST /v1/responses``, declared once as pydantic
models and validated once at the edge (:func:`parse_create`), as vLLM's
``protocol.py`` declares its requests: types, defaults and what we refuse live
here, and the rest of the Responses API (``responses_input.py``,
``responses_api.py``) reads a request that is already valid.

    CreateRequest            the body; an unknown field is a 400 naming it
      input                  a string (one user message) or a list of items:
        MessageItem            role user | system | developer | assistant,
                               content a string or text parts (input_text,
                               output_text, text); images and files: 400
        FunctionCallItem       call_id, name, arguments (what we returned)
        FunctionCallOutputItem call_id, output (a string or text parts)
        ReasoningItem          accepted and dropped (not fed back)
      tools                  FunctionTool only; built-in tools: 400
      tool_choice            none | auto | required | {type: function, name}
      text.format            text | json_object | json_schema
      reasoning              effort (chat's reasoning_effort); summary: 400
      truncation             disabled only; include, a verbosity other than
                             medium, a service tier other than auto / default,
                             stream_options.include_obfuscation: 400

Fields of items we returned ourselves (``id``, ``status``, ``annotations``,
``logprobs``) are accepted as the official clients send them back. Every
model forbids other fields and converts no types (``strict``: ``"1"`` is not
a number nor ``"true"`` a boolean). A validation error becomes one 400:
``param`` the top-level field, the message the path to the bad value and
what is wrong with it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from router.openai.errors import APIError, bad_request

MAX_METADATA_KEYS = 16
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class TextPart(_Shape):
    """A text content part (``input_text`` sent, ``output_text`` returned)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: Optional[list] = None
    logprobs: Optional[list] = None


def _text_parts(value: Any) -> Any:
    """Refuses a content part that is not text with a message that says so."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ValueError(f"a content part of type {kind!r}: only text parts (input_text, output_text) "
                                 "are supported")
    return value


class MessageItem(_Shape):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _text_parts(value)


class FunctionCallItem(_Shape):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class FunctionCallOutputItem(_Shape):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    @field_validator("output", mode="before")
    @classmethod
    def _parts(cls, value: Any) -> Any:
        return _text_parts(value)


class ReasoningItem(_Shape):
    """A reasoning item sent back: dropped (the templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: Optional[list] = None
    content: Optional[list] = None
    encrypted_content: Optional[str] = None
    status: Optional[str] = None


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                      Field(discriminator="type")]


class FunctionTool(_Shape):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class FunctionChoice(_Shape):
    type: Literal["function"]
    name: str


class TextFormat(_Shape):
    type: Literal["text"]


class JsonObjectFormat(_Shape):
    type: Literal["json_object"]


class JsonSchemaFormat(_Shape):
    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(_Shape):
    format: Optional[Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat],
                               Field(discriminator="type")]] = None
    verbosity: Optional[Literal["medium"]] = None  # OpenAI's default; low / high are not honoured


class ReasoningConfig(_Shape):
    effort: Optional[str] = None  # checked against the chat template (router.reasoning.effort_template_kwargs)
    summary: Optional[str] = None
    generate_summary: Optional[str] = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summary(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            raise ValueError("not supported (the reasoning is returned whole, not summarized): leave it unset")
        return value


class StreamOptions(_Shape):
    include_obfuscation: Optional[Literal[False]] = None  # events are never padded


class CreateRequest(_Shape):
    """A create request, valid as a whole once constructed."""

    model: Optional[str] = None
    input: list[InputItem] = Field(min_length=1)
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    stream: bool = False
    background: bool = False
    max_output_tokens: Optional[int] = None  # bounds: the chat path's limits
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[str] = None
    include: Optional[list] = None
    service_tier: Optional[Literal["auto", "default"]] = None
    stream_options: Optional[StreamOptions] = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
        if isinstance(value, list):
            out = []
            for i, item in enumerate(value):
                if isinstance(item, dict) and "type" not in item and "role" in item:
                    item = {**item, "type": "message"}  # an easy input message
                kind = item.get("type") if isinstance(item, dict) else None
                if kind not in ITEM_TYPES:
                    raise ValueError(f"item {i} has type {kind!r}: supported items are message, function_call, "
                                     "function_call_output (and reasoning, which is dropped)")
                out.append(item)
            return out
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} has type {kind!r}: only function tools are supported (no built-in "
                                 "tools such as web search, file search, code interpreter, computer use or MCP)")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required") or (
                isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}
                and isinstance(value["name"], str)):
            return value
        raise ValueError("must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, value: Optional[str]) -> Optional[str]:
        if value not in (None, "disabled"):
            raise ValueError(f"{value!r} is not supported: leave it unset or 'disabled' (a prompt over the model's "
                             "length is a 400)")
        return value

    @field_validator("include")
    @classmethod
    def _include(cls, value: Optional[list]) -> Optional[list]:
        if value:
            raise ValueError("not supported: leave it unset")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Optional[dict]) -> Optional[dict]:
        if value is not None and len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _background(self) -> "CreateRequest":
        if self.background and not self.store:
            raise ValueError("a background response is stored (it is polled by id): leave store unset or true")
        if self.background and self.stream:
            raise ValueError("streaming a background response is not supported: poll it with GET "
                             "/v1/responses/{id}, or leave background unset")
        return self


def parse_create(body: Any) -> CreateRequest:
    """The create request of a decoded JSON body.

    Raises:
        APIError: 400 naming the top-level field at fault and the path to the bad value.
    """
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    if "input" not in body:
        raise bad_request("input is required: a string or a list of input items", "input")
    try:
        return CreateRequest.model_validate(body)
    except ValidationError as exc:
        raise _api_error(exc.errors()[0], body) from None


def _api_error(error: Any, body: dict) -> APIError:
    loc = error.get("loc") or ()
    message = error.get("msg", "is invalid")
    if error.get("type") == "extra_forbidden" and len(loc) == 1:
        return bad_request(f"unknown or unsupported field {loc[0]!r} for /v1/responses: remove it", str(loc[0]))
    if error.get("type") == "value_error":
        message = message.removeprefix("Value error, ")
    if not loc:  # a model-level check (background with stream or without store)
        param = "stream" if "streaming" in message else "store"
        return bad_request(message, param)
    path = str(loc[0]) + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[1:])
    return bad_request(f"{path}: {message}", str(loc[0]))
