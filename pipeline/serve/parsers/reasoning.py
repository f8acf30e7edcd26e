"""Reasoning split, as SGLang 0.5.23's `sglang/srt/parser/reasoning_parser.py` does it without streaming.

`BaseReasoningFormatDetector._detect_and_parse_impl` and `detect_and_parse`, with the settings of
`DeepSeekR1Detector` and `Qwen3Detector`, and the `force_reasoning` handling of `ReasoningParser.__init__`;
`chat_force_reasoning` is what `serving_chat.OpenAIServingChat` passes as `force_reasoning`
(`template_manager.force_reasoning or _get_reasoning_from_request(request)`).
Not modelled: `continue_final_message` (`previous_content`), the streaming path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class _Format:
    force_reasoning: bool  # the detector's default (`ReasoningParser` passes none unless told)
    always_forced: bool  # the detector or `ReasoningParser` overrides whatever it is told with True
    tool_start: str | None  # a token that ends an unclosed reasoning block (kept in the content)
    default_mode: str  # the detector's `reasoning_default`, read by `_get_reasoning_from_request`


# SGLang's names (`ReasoningParser.DetectorMap`) for the two detectors modelled here.
_FORMATS: dict[str, _Format] = {
    # DeepSeekR1Detector: super().__init__(force_reasoning=True) whatever it is given.
    "deepseek-r1": _Format(force_reasoning=True, always_forced=True, tool_start=None, default_mode="always"),
    # Qwen3Detector: tool_start_token="<tool_call>" (not only at a line start), reasoning_default="enable_thinking".
    "qwen3": _Format(force_reasoning=False, always_forced=False, tool_start="<tool_call>",
                     default_mode="enable_thinking"),
    # Qwen3Detector too; `ReasoningParser` sets force_reasoning=True for this name.
    "qwen3-thinking": _Format(force_reasoning=False, always_forced=True, tool_start="<tool_call>",
                              default_mode="enable_thinking"),
}

REASONING_PARSERS: tuple[str, ...] = tuple(sorted(_FORMATS))


def _format(parser: str) -> _Format:
    # `ReasoningParser` looks the name up lower-cased.
    found = _FORMATS.get(parser.lower())
    if found is None:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")
    return found


def parse_reasoning(text: str, parser: str | None, *, force_reasoning: bool | None = None,
                    force_nonempty_content: bool = False) -> tuple[str | None, str]:
    """`(reasoning_content, rest)` of a completion, as SGLang's `ReasoningParser(parser,
    stream_reasoning=False, force_reasoning=...).parse_non_stream(text)` splits it, with an empty
    reasoning reported as None (as the chat response does). `parser=None`: no reasoning parser.

    `force_reasoning=None` leaves the detector's default, as `ReasoningParser` does (qwen3: off;
    deepseek-r1 and qwen3-thinking: always on, whatever is passed). SGLang's chat handler always
    passes a value: `chat_force_reasoning` computes it, and for qwen3 it is on unless the request
    says `enable_thinking: false`. With reasoning forced (or a `<think>` anywhere in the text):
    leading `<think>`s are dropped, the text up to the first `</think>` is reasoning and the rest is
    content; without a `</think>`, everything is reasoning, except (qwen3) from the first
    `<tool_call>` on, which is content. `force_nonempty_content` (a `chat_template_kwargs` switch)
    hands the reasoning over as content when the content would be empty."""
    if parser is None:
        return None, text
    fmt = _format(parser)
    forced = True if fmt.always_forced else (fmt.force_reasoning if force_reasoning is None else force_reasoning)
    reasoning, normal = _split(text, fmt, forced)
    if force_nonempty_content and not normal:
        # `_maybe_apply_force_nonempty_content`: swap.
        reasoning, normal = normal, reasoning
    return (reasoning or None), normal


def _split(text: str, fmt: _Format, forced: bool) -> tuple[str, str]:
    """`BaseReasoningFormatDetector._detect_and_parse_impl`: (reasoning_text, normal_text)."""
    if not (forced or THINK_START in text):
        return "", text
    processed = text
    while processed.startswith(THINK_START):  # think_start_self_label is "" for these detectors
        processed = processed[len(THINK_START):]
    if THINK_END not in processed:
        # The tool start interrupts reasoning anywhere (tool_start_at_line_start=False), so the
        # detector's `_strip_partial_tool_start` leaves the text as it is.
        tool_idx = processed.find(fmt.tool_start) if fmt.tool_start else -1
        if tool_idx != -1:
            return processed[:tool_idx], processed[tool_idx:]
        return processed, ""  # reasoning cut short before its end token
    reasoning, normal = processed.split(THINK_END, 1)
    return reasoning, normal


def chat_force_reasoning(parser: str | None, chat_template_kwargs: Mapping[str, Any] | None = None) -> bool:
    """The `force_reasoning` SGLang's chat handler gives its `ReasoningParser`: the template's
    `force_reasoning or _get_reasoning_from_request(request)`, for a chat template that SGLang finds
    no reasoning switch in or reads as Qwen3's (`enable_thinking`, on by default). Both give the
    parser's `reasoning_default`: for qwen3, on unless `chat_template_kwargs` has
    `enable_thinking: false` (an empty dict counts as absent); for deepseek-r1, always on (its
    detector forces reasoning whatever it is told anyway).

    Templates that SGLang reads otherwise (`enable_thinking` off by default, a `thinking` switch,
    a template that opens `<think>` itself) are not modelled."""
    if parser is None:
        return False
    fmt = _format(parser)
    if fmt.default_mode == "always":
        return True
    kwargs = chat_template_kwargs
    return not kwargs or kwargs.get(fmt.default_mode) is not False
