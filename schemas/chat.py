"""A chat request line: OpenAI-shaped `messages` (or `prompt` text) instead of `input_ids`.

Rendered into token ids at submit time (`pipeline.submit.render`), so the queue only ever carries
ids. The shape and the rejections follow SGLang's `ChatCompletionRequest`
(`srt/entrypoints/openai/protocol.py`) for the text-only Jinja-template path:

- roles are matched case-insensitively against SGLang's list; a `user` message needs content;
- content is a string, `null`, or a list of `text` parts (and `thinking`/`reasoning` parts in
  assistant messages, which templates never see); media parts are rejected (text-only);
- `tools` on a `system`/`developer`/`root` message count towards the effective tools;
- `tool_choice` defaults to `"none"` without tools and `"auto"` with them.

Unlike SGLang (which ignores them), unknown fields are errors, as on every request line.
The sampling, logprob and metadata fields are those of `RolloutRequest`, reused, not copied;
a line is validated again as a `RolloutRequest` once rendered.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    create_model,
    field_validator,
    model_validator,
)

from schemas.request import RolloutRequest, TokenId

# SGLang's `_GenericMessageRole`; "user" is a separate message type there.
GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
TOOL_HOST_ROLES = ("root", "system", "developer")
# The fields a chat line shares with a token-id line (same types, same constraints).
SHARED_FIELDS = ("id", "sampling_params", "logprobs", "prompt_logprobs", "return_routed_experts", "metadata",
                 "routing_key", "adapter")
# The fields that stand in for `input_ids` (exactly one of them, rendered at submit).
CHAT_INPUTS = ("messages", "prompt")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ThinkingPart(_Strict):
    """Reasoning in an assistant message; SGLang drops it before the template sees the message."""

    type: Literal["thinking", "reasoning"]
    thinking: StrictStr | None = None
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _one_payload(self) -> ThinkingPart:
        if (self.thinking is None) == (self.text is None):
            raise ValueError("thinking parts require exactly one of 'thinking' or 'text'")
        return self


ContentPart = Annotated[TextPart | ThinkingPart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: StrictStr | None = None
    # A JSON string (as OpenAI sends it) or an object; a string must parse to an object.
    arguments: StrictStr | dict[str, Any] | None = None


class ToolCall(_Strict):
    id: StrictStr | None = None
    index: StrictInt | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    """A tool's function. The client's key order is kept: templates render the schema as given."""

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None
    _key_order: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _capture_key_order(cls, data: Any, handler: Any) -> FunctionDef:
        model = handler(data)
        if isinstance(data, dict):
            model._key_order = list(data)
        return model

    def template_dict(self) -> dict[str, Any]:
        """SGLang's `Function` dump: client key order, then the fields left out (unset `strict` omitted)."""
        data: dict[str, Any] = {"description": self.description, "name": self.name, "parameters": self.parameters}
        if self.strict is not None:
            data["strict"] = self.strict
        order = [k for k in self._key_order if k in data]
        return {k: data[k] for k in order + [k for k in data if k not in order]}


class Tool(_Strict):
    type: StrictStr = "function"
    function: FunctionDef

    def template_dict(self) -> dict[str, Any]:
        """SGLang's `Tool.model_dump()`: its `defer_loading` stays as null."""
        return {"type": self.type, "function": self.function.template_dict(), "defer_loading": None}


class ToolChoiceFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatMessage(_Strict):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tools: list[Tool] | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _normalize_role(cls, value: Any) -> Any:
        if not isinstance(value, str):
            raise ValueError("'role' must be a string")
        if value == "user":
            return value
        # SGLang lower-cases every role but "user", which only matches exactly.
        lower = value.lower()
        if lower not in GENERIC_ROLES:
            allowed = ", ".join(repr(r) for r in GENERIC_ROLES)
            raise ValueError(f"'role' must be 'user' or one of {allowed} (case-insensitive).")
        return lower

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        if self.role == "user" and self.content is None:
            raise ValueError("a user message needs content (a string or a list of text parts)")
        if (self.role != "assistant" and isinstance(self.content, list)
                and any(isinstance(part, ThinkingPart) for part in self.content)):
            raise ValueError("thinking content parts are only valid in assistant messages")
        return self


class ContinueFrom(_Strict):
    """An earlier rollout's row to continue: its ids are kept verbatim, never re-tokenized."""

    prompt_token_ids: Annotated[list[TokenId], Field(min_length=1)]
    completion_token_ids: list[TokenId]


def _shared_fields() -> dict[str, Any]:
    fields = RolloutRequest.model_fields
    return {name: (fields[name].annotation, fields[name]) for name in SHARED_FIELDS}


_ChatRequestBase: type[_Strict] = create_model(  # type: ignore[call-overload]
    "_ChatRequestBase", __base__=_Strict, **_shared_fields()
)


class ChatRequest(_ChatRequestBase):  # type: ignore[misc, valid-type]
    """A request line with `messages` (chat) or `prompt` (plain text) in place of `input_ids`."""

    messages: list[ChatMessage] | None = None
    prompt: StrictStr | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedToolChoice | None = None
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    continue_from: ContinueFrom | None = None

    @model_validator(mode="after")
    def _one_input(self) -> ChatRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages, prompt or input_ids")
        if self.prompt is not None:
            chat_only = [name for name in ("tools", "tool_choice", "chat_template_kwargs", "continue_from")
                         if getattr(self, name) is not None]
            if chat_only or self.continue_final_message:
                raise ValueError(f"{', '.join(chat_only) or 'continue_final_message'} needs messages, not prompt")
        return self

    @functools.cached_property
    def hosted_tools(self) -> list[Tool]:
        """The tools hosted on system/developer/root messages, in order (one walk of the messages a request)."""
        return [tool for message in self.messages or [] if message.role in TOOL_HOST_ROLES and message.tools
                for tool in message.tools]

    @property
    def effective_tools(self) -> list[Tool]:
        """Request tools plus those hosted on system/developer/root messages (SGLang's `_effective_tools`)."""
        return [*(self.tools or []), *self.hosted_tools]

    @property
    def resolved_tool_choice(self) -> str | NamedToolChoice:
        """SGLang's default: "none" without any tools, else "auto"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.effective_tools else "none"


def is_chat_line(data: dict[str, Any]) -> bool:
    """A line to render (messages or prompt) rather than a token-id line."""
    return "input_ids" not in data and any(name in data for name in CHAT_INPUTS)


# The fields of a chat line that a token-id line does not have (the inputs, tools, template options).
CHAT_FIELDS = frozenset(ChatRequest.model_fields) - frozenset(RolloutRequest.model_fields)
