"""Completion text to an OpenAI chat answer (content, reasoning_content, tool_calls), as SGLang 0.5.23 does.

For `pipeline serve`, whose answers must be the ones SGLang's own OpenAI server would give for the
same completion text. Pure Python, no SGLang at run time; the rules are ports, each module says of
which files of the `sglang` 0.5.23 wheel:

- `reasoning`: `srt/parser/reasoning_parser.py` (`qwen3`, `qwen3-thinking`, `deepseek-r1`), and
  the `force_reasoning` that `srt/entrypoints/openai/serving_chat.py` passes;
- `tool_calls`: `srt/function_call/{qwen25,hermes,llama32,mistral,deepseekv3}_detector.py`,
  `base_format_detector.py`, `utils.py`, `function_call_parser.py` (the parser names),
  and `serving_chat.py`'s `_process_tool_calls`.

`parse_chat_answer` chains them in `OpenAIServingChat._build_chat_response`'s order (reasoning
first, tool calls in what is left). Unknown parser names raise ValueError naming the known ones.
tests/pipeline/serve/test_parsing.py checks all of it against SGLang's own classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.serve.parsers.reasoning import REASONING_PARSERS, chat_force_reasoning, parse_reasoning
from pipeline.serve.parsers.tool_calls import CALL_AT_START, CALL_MARKERS, TOOL_CALL_PARSERS, ToolCall, parse_tool_calls

__all__ = [
    "CALL_AT_START",
    "CALL_MARKERS",
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "ChatAnswer",
    "ToolCall",
    "chat_force_reasoning",
    "parse_chat_answer",
    "parse_reasoning",
    "parse_tool_calls",
]


@dataclass(frozen=True)
class ChatAnswer:
    """The parsed parts of one choice's assistant message. `content` is never None (SGLang answers
    "" rather than null); `finish_reason` is "tool_calls" where a "stop" ended a turn with calls
    (SGLang then also reports `matched_stop` as null)."""

    content: str
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None


def parse_chat_answer(text: str, *, reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                      tools: list[dict[str, Any]] | None = None,
                      chat_template_kwargs: Mapping[str, Any] | None = None,
                      finish_reason: str | None = "stop") -> ChatAnswer:
    """One choice of SGLang's non-streamed chat answer from its completion text. The caller
    passes `reasoning_parser=None` when the request has `separate_reasoning: false`, and
    `tool_call_parser=None` (or no tools) when `tool_choice` is "none"; `chat_template_kwargs`
    are the request's merged with the server's defaults (they decide `force_reasoning`)."""
    kwargs = chat_template_kwargs or {}
    reasoning, rest = parse_reasoning(
        text, reasoning_parser,
        force_reasoning=chat_force_reasoning(reasoning_parser, kwargs),
        force_nonempty_content=kwargs.get("force_nonempty_content") is True,
    )
    calls: list[ToolCall] = []
    if tool_call_parser is not None:
        rest, calls = parse_tool_calls(rest, tools or [], tool_call_parser)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatAnswer(content=rest or "", reasoning_content=reasoning, tool_calls=tuple(calls),
                      finish_reason=finish_reason)
