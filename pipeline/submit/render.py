"""Chat messages (or prompt text) to token ids at submit time, exactly as SGLang's chat endpoint would.

The rules are those of SGLang's `OpenAIServingChat` on the plain Jinja-template path
(`srt/entrypoints/openai/serving_chat.py`: `_validate_request`, `_process_messages`,
`_apply_jinja_template`, `_handle_last_assistant_message`,
`_append_assistant_prefix_to_prompt_ids`, `_render_and_encode_chat_template`):

- tools reach the template only when `tool_choice` is not "none": all request tools, or only
  the named one;
- messages are dumped as SGLang dumps them, `null` content becomes "", `null` keys dropped,
  content parts joined with " " for templates that expect strings (kept as parts for
  templates that loop over `message.content`), tool results' text parts always joined,
  assistant tool-call arguments parsed from JSON;
- a final assistant message becomes a user message, unless `continue_final_message`: then
  the template renders without it, with the generation prompt, and its content is appended
  as separately encoded ids with a leading BOS dropped;
- the template is rendered to text and encoded (without special tokens when the tokenizer
  adds them), unless that round trip is lossy, in which case the template tokenizes;
- `prompt` text is encoded as SGLang's `/generate` encodes `text` (special tokens added).

Multi-turn without drift: a line with `continue_from` (an earlier row's prompt and
completion ids) keeps those ids verbatim and appends only the rendering of what follows
the earlier reply. This needs a template that renders a conversation as an extension of
its shorter prefix; `RenderError` says so when it does not.

Nothing here imports transformers until a tokenizer is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.core.errors import REQUESTS, LineError, PipelineError, RenderError, RequestFileError
from pipeline.submit.extension_window import ExtensionWindow
from schemas.chat import SHARED_FIELDS, ChatMessage, ChatRequest, NamedToolChoice, TextPart, is_chat_line

# Stands for an earlier reply's content in `ChatRenderer.render_after_reply`.
_REPLY_MARK = "\u2063reply\u2063"


@dataclass(frozen=True)
class Rendered:
    """Token ids for the queue and the text they stand for (kept in the row)."""

    input_ids: list[int]
    prompt_text: str


# ---------------------------------------------------------------------------------------
# Template analysis (SGLang's `detect_jinja_template_content_format`)


def _is_var(node: Any, name: str) -> bool:
    import jinja2.nodes as nodes

    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: Any, name: str, key: str) -> bool:
    import jinja2.nodes as nodes

    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: Any, name: str, key: str) -> bool:
    import jinja2.nodes as nodes

    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key)


def content_format(chat_template: str | None) -> str:
    """'openai' when the template loops over message content parts, else 'string'."""
    if not chat_template:
        return "string"
    if any(word in chat_template for word in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        import jinja2.nodes as nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template

        ast = _compile_jinja_template(chat_template).environment.parse(chat_template)
        for loop in ast.find_all(nodes.For):
            if any(_is_var_or_elems(loop.iter, name, "content") for name in ("message", "msg", "m")):
                return "openai"
    except Exception:
        return "string"
    return "string"


# ---------------------------------------------------------------------------------------
# Message preparation


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """SGLang's `model_dump()` of a message, tool-call arguments parsed."""
    content: Any = message.content
    if isinstance(content, list):
        content = [part.model_dump() for part in content]
    if message.role == "user":
        return {"role": "user", "content": content}
    tool_calls = None
    if message.tool_calls is not None:
        tool_calls = []
        for number, call in enumerate(message.tool_calls):
            dumped = call.model_dump()
            arguments = dumped["function"]["arguments"]
            if message.role == "assistant" and isinstance(arguments, str):
                where = f"messages[{index}].tool_calls[{number}].function.arguments"
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    raise RenderError(where, "Assistant tool call function.arguments must be valid JSON.") from None
                if not isinstance(arguments, dict):
                    raise RenderError(where, "Assistant tool call function.arguments must be a JSON object.")
                dumped["function"]["arguments"] = arguments
            tool_calls.append(dumped)
    return {
        "role": message.role,
        "content": content,
        "tool_call_id": message.tool_call_id,
        "name": message.name,
        "reasoning_content": message.reasoning_content,
        "tool_calls": tool_calls,
        "tools": None if message.tools is None else [tool.template_dict() for tool in message.tools],
    }


def _for_template(message: dict[str, Any], fmt: str) -> dict[str, Any]:
    """`process_content_for_template_format` then `normalize_tool_content`, text-only."""
    message = dict(message)
    if message.get("content") is None:
        message["content"] = ""
    content = message["content"]
    if isinstance(content, list):
        texts = [part["text"] for part in content if part.get("type") == "text"]
        if fmt == "openai":
            message["content"] = [{"type": "text", "text": text} for text in texts]
        else:
            message["content"] = " ".join(texts)
    message = {k: v for k, v in message.items() if v is not None}
    if message["role"] == "tool" and isinstance(message["content"], list):
        message["content"] = " ".join(part["text"] for part in message["content"])
    return message


def _split_final_assistant(
    messages: list[dict[str, Any]], continue_final_message: bool
) -> tuple[list[dict[str, Any]], str | None]:
    """SGLang's `_handle_last_assistant_message`."""
    if messages and messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), str):
        content = messages[-1]["content"]
        if continue_final_message:
            return messages[:-1], content
        messages = [*messages[:-1], {"role": "user", "content": content}]
    return messages, None


# ---------------------------------------------------------------------------------------
# Validation (SGLang's `_validate_request`, the parts that apply to a text-only Jinja path)


def _validate(request: ChatRequest) -> None:
    if not request.messages:
        raise RenderError("messages", "Messages cannot be empty.")
    if request.chat_template_kwargs and "chat_template" in request.chat_template_kwargs:
        raise RenderError(
            "chat_template_kwargs.chat_template",
            "Request-supplied chat_template is not allowed (SGLang refuses it unless started with "
            "--trust-request-chat-template); render with the model's own template",
        )
    tools = request.effective_tools
    choice = request.tool_choice
    if isinstance(choice, str) and choice == "required" and not tools:
        raise RenderError("tool_choice", "Tools cannot be empty if tool choice is set to required.")
    if isinstance(choice, NamedToolChoice):
        if not tools:
            raise RenderError("tool_choice", "Tools cannot be empty if tool choice is set to a specific tool.")
        if not any(tool.function.name == choice.function.name for tool in tools):
            raise RenderError("tool_choice.function.name", f"Tool '{choice.function.name}' not found in tools list.")
    if request.hosted_tools:
        names = [tool.function.name for tool in tools]
        if len(names) != len(set(names)):
            raise RenderError("tools", "Tool names must be unique across request and message tools.")
    for i, tool in enumerate(tools):
        if tool.function.parameters is None:
            continue
        try:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError
        except ImportError:  # pragma: no cover - jsonschema ships with the test extras
            return
        try:
            Draft202012Validator.check_schema(tool.function.parameters)
        except SchemaError as exc:
            raise RenderError("tools", f"Tool {i} function has invalid 'parameters' schema: {exc}") from None


def _template_tools(request: ChatRequest) -> list[dict[str, Any]] | None:
    """The tools the template sees (SGLang's `_process_messages`)."""
    choice = request.resolved_tool_choice
    if not request.effective_tools or choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        named = [t.template_dict() for t in request.tools or [] if t.function.name == choice.function.name]
        return named or None
    if request.tools:
        return [t.template_dict() for t in request.tools]
    return None


# ---------------------------------------------------------------------------------------
# The renderer


class ChatRenderer:
    """Renders chat and prompt request lines with one tokenizer (a path or a loaded tokenizer)."""

    def __init__(self, tokenizer: Any, window: ExtensionWindow | None = None) -> None:
        if isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
            except (OSError, ValueError) as exc:
                raise PipelineError(f"cannot load a tokenizer from {tokenizer}: {exc}") from exc
        self.tokenizer = tokenizer
        self.content_format = content_format(getattr(tokenizer, "chat_template", None))
        try:
            self.auto_adds_specials = len(tokenizer.encode("")) > 0
        except Exception:
            self.auto_adds_specials = True
        self.round_trip_lossy = self._probe_round_trip()
        self.window = window or ExtensionWindow()

    # SGLang's `_probe_prompt_text_round_trip`.
    def _probe_round_trip(self) -> bool:
        probe = [{"role": "user", "content": "x"}]
        try:
            text = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                                      return_dict=False)
            via_ids = self.tokenizer.apply_chat_template(probe, tokenize=True, add_generation_prompt=True,
                                                         return_dict=False)
            return list(self._encode_prompt(text)) != list(via_ids)
        except Exception:
            return False

    def _encode_prompt(self, text: str) -> list[int]:
        kwargs = {"add_special_tokens": False} if self.auto_adds_specials else {}
        return list(self.tokenizer.encode(text, **kwargs))

    def _prefix_ids(self, prefix: str) -> list[int]:
        encoded = list(self.tokenizer.encode(prefix))
        if encoded and encoded[0] == self.tokenizer.bos_token_id:
            encoded = encoded[1:]
        return encoded

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any], *, tokenize: bool) -> Any:
        # Not copied: `template_messages` built these dicts for this render, and transformers hands the
        # template dicts of its own (`_normalize_chat_messages`) in an immutable sandbox.
        return self.tokenizer.apply_chat_template(
            messages, tokenize=tokenize, add_generation_prompt=True, tools=tools,
            return_dict=False, **kwargs,
        )

    def _render_text_and_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], *,
        ids: bool = True,
    ) -> tuple[str, list[int] | None]:
        """The template's text and (when `ids`) its token ids; without `ids` nothing is tokenized."""
        def once(tools_now: list[dict[str, Any]] | None) -> tuple[str, list[int] | None]:
            text = self._apply(messages, tools_now, kwargs, tokenize=False)
            if not ids:
                return text, None
            if self.round_trip_lossy:
                return text, list(self._apply(messages, tools_now, kwargs, tokenize=True))
            return text, self._encode_prompt(text)

        try:
            return once(tools)
        except Exception:
            # Some templates (e.g. Mistral's) want tools without the OpenAI wrapper.
            flat = [t.get("function", t) for t in tools] if tools else None
            try:
                return once(flat)
            except Exception as exc:
                raise RenderError("messages", f"the chat template failed: {exc}") from None

    def template_messages(self, messages: Sequence[ChatMessage], positions: Sequence[int] | None = None
                          ) -> list[dict[str, Any]]:
        """The message dicts as the template receives them, before the final-assistant rule (`positions`:
        each message's index in the request, for errors; default 0, 1, ...)."""
        return [_for_template(_message_dict(m, i), self.content_format)
                for i, m in zip(positions or range(len(messages)), messages, strict=True)]

    def _render_messages(self, request: ChatRequest, messages: Sequence[ChatMessage], *,
                         ids: bool = True, positions: Sequence[int] | None = None
                         ) -> tuple[str, list[int] | None, str]:
        """(template text, its ids (None unless `ids`), the continued assistant prefix or "")."""
        prepared = self.template_messages(messages, positions)
        prepared, prefix = _split_final_assistant(prepared, request.continue_final_message)
        kwargs = dict(request.chat_template_kwargs or {})
        text, token_ids = self._render_text_and_ids(prepared, _template_tools(request), kwargs, ids=ids)
        return text, token_ids, prefix or ""

    def render(self, request: ChatRequest) -> Rendered:
        """Token ids and prompt text for a validated chat or prompt request."""
        if request.prompt is not None:
            return Rendered(list(self.tokenizer(request.prompt)["input_ids"]), request.prompt)
        _validate(request)
        if request.continue_from is not None:
            return self._render_continuation(request)
        text, ids, prefix = self._render_messages(request, request.messages or [])
        assert ids is not None
        if prefix:
            ids = ids + self._prefix_ids(prefix)
        return Rendered(ids, text + prefix)

    def _render_continuation(self, request: ChatRequest) -> Rendered:
        assert request.continue_from is not None and request.messages is not None
        earlier_ids = list(request.continue_from.prompt_token_ids)
        completion_ids = list(request.continue_from.completion_token_ids)
        messages = request.messages
        # The earlier reply: an assistant message, not the last one, whose preceding messages render to the
        # earlier prompt ids (the latest such message wins).
        first_turn = request.model_copy(update={"continue_final_message": False})
        boundary = None
        for k in range(len(messages) - 2, 0, -1):
            if messages[k].role != "assistant":
                continue
            try:
                earlier_text, ids, _ = self._render_messages(first_turn, messages[:k])
            except RenderError:
                continue
            if ids == earlier_ids:
                boundary = k
                break
        if boundary is None:
            raise RenderError(
                "continue_from.prompt_token_ids",
                "no assistant message (before the last message) is preceded by messages that render to these "
                "prompt ids; give the whole conversation: the earlier turn's messages, its reply as an assistant "
                "message, then the new messages",
            )
        full_text, _, prefix = self._render_messages(request, messages, ids=False)
        if not full_text.startswith(earlier_text):
            at = next(i for i, (a, b) in enumerate(zip(full_text, earlier_text, strict=False)) if a != b) \
                if any(a != b for a, b in zip(full_text, earlier_text, strict=False)) else len(full_text)
            raise RenderError(
                "continue_from",
                "this chat template does not render the conversation as an extension of the earlier turn's prompt "
                f"(it changes the earlier text at character {at}: {earlier_text[at:at + 40]!r} becomes "
                f"{full_text[at:at + 40]!r}), so the earlier ids cannot be kept verbatim; drop continue_from to "
                "submit the conversation re-rendered as a whole",
            )
        middle = full_text[len(earlier_text):]
        completion_text = self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        if not middle.startswith(completion_text):
            raise RenderError(
                f"messages[{boundary}].content",
                f"the template renders the earlier reply as {middle[:len(completion_text) + 20]!r}, which does not "
                f"start with the sampled completion {completion_text!r}; put the row's completion text in that "
                "message (a stop string trimmed from it, or a template that rewrites earlier replies, makes "
                "continuing impossible)",
            )
        extension = middle[len(completion_text):]
        ids = earlier_ids + completion_ids + (self._encode_prompt(extension) if extension else [])
        if prefix:
            ids += self._prefix_ids(prefix)
        return Rendered(ids, full_text + prefix)

    def render_after_reply(self, request: ChatRequest, boundary: int, completion_text: str) -> Rendered:
        """What follows an earlier reply whose sampled ids the caller keeps verbatim (agent turns).

        `request.messages[boundary]` is the assistant message standing for that reply; the
        messages after it are new. The template renders the conversation with a marker in place of
        the reply's content; the text after the marker, less the end of it the sampled completion
        (`completion_text`, decoded with special tokens) already holds (its end-of-turn token), is
        the extension: the template's glue, the new messages and the generation prompt. Only that
        is tokenized, so the sampled ids are never re-tokenized, whatever the template does with
        tool calls or reasoning in earlier replies.

        The template sees a window of the history (`ExtensionWindow`), so a turn's render is
        O(its new messages), not O(the session); the window is checked against the whole history
        as the window's audit says.
        """
        assert request.messages is not None
        messages = request.messages
        setting = self.window.setting(request)
        positions = self.window.positions(setting, messages, boundary)
        if positions is None:
            return self._extension(request, range(len(messages)), boundary, completion_text)
        try:
            extension = self._extension(request, positions, boundary, completion_text)
        except RenderError:  # a template that refuses the window's shape: the whole history decides
            return self._extension(request, range(len(messages)), boundary, completion_text)
        if self.window.audit_due(setting, len(positions), len(messages)):
            whole = self._extension(request, range(len(messages)), boundary, completion_text)
            if whole != extension:
                self.window.refuse(setting, extension.prompt_text, whole.prompt_text)
                return whole
        return extension

    def _extension(self, request: ChatRequest, positions: Sequence[int], boundary: int,
                   completion_text: str) -> Rendered:
        """`render_after_reply` over the messages at `positions` (the whole history, or a window)."""
        assert request.messages is not None
        shown = [ChatMessage(role="assistant", content=_REPLY_MARK) if k == boundary else request.messages[k]
                 for k in positions]
        text, _, prefix = self._render_messages(request, shown, ids=False, positions=positions)
        at = text.find(_REPLY_MARK)
        if at < 0 or text.find(_REPLY_MARK, at + 1) >= 0:
            raise RenderError(f"messages[{boundary}]", "the chat template does not render the earlier reply's "
                                                       "content once, so the turn cannot extend it")
        after = text[at + len(_REPLY_MARK):] + prefix
        held = next((k for k in range(min(len(after), len(completion_text)), 0, -1)
                     if completion_text.endswith(after[:k])), 0)
        extension = after[held:]
        return Rendered(self._encode_prompt(extension) if extension else [], extension)

    # -- the request_file hook -------------------------------------------------------------

    def render_line(self, raw: str | bytes | Mapping[str, Any]) -> str | bytes | dict[str, Any]:
        """A request line with its chat/prompt rendered into `input_ids` (+ `prompt_text`); others unchanged.

        Raises `ValidationError` (located by pydantic) or `RenderError` (located by field).
        """
        if isinstance(raw, Mapping):
            data: Any = dict(raw)
        else:
            try:
                data = json.loads(raw)
            except ValueError:
                return raw  # the token-id validation reports the JSON error
        if not isinstance(data, dict) or not is_chat_line(data):
            return raw if not isinstance(raw, Mapping) else dict(raw)
        request = ChatRequest.model_validate(data)
        rendered = self.render(request)
        line = {name: data[name] for name in SHARED_FIELDS if name in data}
        line["input_ids"] = rendered.input_ids
        line["prompt_text"] = rendered.prompt_text
        return line


def render_requests(requests: Sequence[Any], tokenizer: Any, *, path: str = REQUESTS) -> list[Any]:
    """`Client.submit(..., tokenizer=)`: chat/prompt dicts rendered, everything else passed through."""
    renderer = tokenizer if isinstance(tokenizer, ChatRenderer) else ChatRenderer(tokenizer)
    out: list[Any] = []
    errors: list[LineError] = []
    for index, item in enumerate(requests):
        if not isinstance(item, Mapping):
            out.append(item)
            continue
        try:
            out.append(renderer.render_line(item))
        except ValidationError as exc:
            from pipeline.submit.request_file import validation_errors

            errors.extend(validation_errors(path, index, exc))
        except RenderError as exc:
            errors.append(LineError(path, index, exc.field, exc.message))
    if errors:
        raise RequestFileError(path, errors, len(requests))
    return out


__all__ = ["ChatRenderer", "RenderError", "Rendered", "TextPart", "content_format", "render_requests"]
