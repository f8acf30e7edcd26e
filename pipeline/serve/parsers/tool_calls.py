"""Tool-call extraction, as SGLang 0.5.23's chat handler does it on a whole (non-streamed) completion.

Each format ports a detector's `has_tool_call` and `detect_and_parse` from `sglang/srt/function_call/`:
`qwen25_detector.py` (names qwen25, qwen), `hermes_detector.py` (hermes), `llama32_detector.py`
(llama3), `mistral_detector.py` (mistral), `deepseekv3_detector.py` (deepseekv3), with
`BaseFormatDetector.parse_base_json` (`base_format_detector.py`) and `_is_complete_json` (`utils.py`).
Around them, `FunctionCallParser.parse_non_stream` (`function_call_parser.py`) and
`OpenAIServingChat._process_tool_calls` (`entrypoints/openai/serving_chat.py`): no tools, no
parsing; no marker, the text untouched; an exception anywhere, the text untouched and no calls;
a marker without a complete call to a declared tool, the detector's normal text and no calls.
The parsers' own bugs and quirks are kept on purpose: the answer must be SGLang's.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One call of an assistant message: `arguments` is JSON text; `index` is the call's position in
    the answer (the `index` SGLang's response carries), not the tool's position in `tools`."""

    name: str
    arguments: str
    index: int


_Found = tuple[str, list[tuple[str, str]]]  # (normal_text, [(name, arguments JSON)])


def _parse_base_json(action: Any, names: set[str]) -> list[tuple[str, str]]:
    """`BaseFormatDetector.parse_base_json` with SGLANG_FORWARD_UNKNOWN_TOOLS off (its default):
    calls to undeclared tools are dropped. A non-object call raises (AttributeError), as there."""
    if not isinstance(action, list):
        action = [action]
    found = []
    for act in action:
        name = act.get("name")
        if not (name and name in names):
            logger.debug("model called an undeclared tool %r: dropped", name)
            continue
        arguments = act.get("parameters") or act.get("arguments", {})
        found.append((name, json.dumps(arguments, ensure_ascii=False)))
    return found


def _orjson_accepts(text: str) -> bool:
    """`utils._is_complete_json` (`orjson.loads` succeeds) with the standard library: orjson also
    refuses NaN/Infinity, numbers that overflow a double, and lone surrogates."""

    def refuse(_: str) -> Any:
        raise ValueError("not JSON")

    def parse_float(literal: str) -> float:
        value = float(literal)
        if math.isinf(value):
            raise ValueError("overflow")
        return value

    def has_surrogate(value: Any) -> bool:
        if isinstance(value, str):
            return any("\ud800" <= ch <= "\udfff" for ch in value)
        if isinstance(value, dict):
            return any(has_surrogate(k) or has_surrogate(v) for k, v in value.items())
        if isinstance(value, list):
            return any(has_surrogate(v) for v in value)
        return False

    try:
        value = json.loads(text, parse_constant=refuse, parse_float=parse_float)
    except (ValueError, RecursionError):
        return False
    return not has_surrogate(value)


# --- qwen25 (qwen25_detector.py) ---

_QWEN_BOT, _QWEN_EOT = "<tool_call>\n", "\n</tool_call>"
_QWEN_CALL = re.compile(rf"{re.escape(_QWEN_BOT)}(.*?){re.escape(_QWEN_EOT)}", re.DOTALL)


def _qwen25(text: str, names: set[str]) -> _Found:
    # Only the text before the first call is kept: whatever follows the calls is dropped.
    normal = text[:text.find(_QWEN_BOT)].strip()
    calls = []
    for body in _QWEN_CALL.findall(text):
        try:
            parsed = json.loads(body.strip())
        except json.JSONDecodeError:
            continue  # this call only
        calls.extend(_parse_base_json(parsed, names))
    return normal, calls


# --- hermes (hermes_detector.py) ---

_HERMES_BOT = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def _hermes(text: str, names: set[str]) -> _Found:
    normal = text[:text.find(_HERMES_BOT)].strip()
    calls = []
    try:
        for closed, unclosed in _HERMES_CALL.findall(text):
            raw = closed or unclosed
            if not raw:
                continue
            calls.extend(_parse_base_json(json.loads(raw.strip()), names))
    except Exception:
        return text, []  # one bad call: the whole text is content, no call
    return normal, calls


# --- llama3 (llama32_detector.py) ---

_PYTHON_TAG = "<|python_tag|>"
_LLAMA_SEPARATOR = ";"


def _python_dict_as_json(text: str) -> str:
    """`Llama32Detector._convert_python_dict_to_json` (`utils.safe_literal_eval`)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=SyntaxWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            parsed = ast.literal_eval(text.strip())
        if isinstance(parsed, dict):
            return json.dumps(parsed, ensure_ascii=False)
    except Exception:
        pass
    return text


def _llama3(text: str, names: set[str]) -> _Found:
    if _PYTHON_TAG in text:
        normal, action_text = text.split(_PYTHON_TAG, 1)
    else:
        normal, action_text = "", text
    decoder = json.JSONDecoder()
    idx = safe_idx = 0
    actions: list[Any] = []
    size = len(action_text)
    while idx < size:
        try:
            obj, end = decoder.raw_decode(action_text[idx:])  # no leading whitespace allowed
            actions.append(obj)
            idx += end + len(_LLAMA_SEPARATOR)  # skips one character, whatever it is
            safe_idx = idx
        except json.JSONDecodeError:
            try:  # a Python dict literal, found by brace counting (strings not considered)
                dict_end = idx
                depth = 0
                for i in range(idx, size):
                    if action_text[i] == "{":
                        depth += 1
                    elif action_text[i] == "}":
                        depth -= 1
                        if depth == 0:
                            dict_end = i + 1
                            break
                if dict_end > idx:
                    candidate = action_text[idx:dict_end]
                    as_json = _python_dict_as_json(candidate)
                    if as_json != candidate:
                        obj, _ = decoder.raw_decode(as_json)
                        actions.append(obj)
                        idx = dict_end + len(_LLAMA_SEPARATOR)
                        safe_idx = idx
                        continue
            except Exception:
                pass
            next_start = action_text.find('{"name":', idx + 1)
            if next_start == -1:
                break
            idx = next_start
    calls = _parse_base_json(actions, names) if actions else []
    trailing = action_text[safe_idx:].strip() if safe_idx < size else ""
    return normal + trailing, calls


# --- mistral (mistral_detector.py) ---

_MISTRAL_MARKER = "[TOOL_CALLS"
_MISTRAL_BOT = "[TOOL_CALLS] ["


def _balanced(text: str, start: int, opening: str, closing: str) -> str | None:
    """The bracketed value from `text[start]` by bracket counting outside strings
    (`_extract_json_value` / `_extract_json_array`), or None when it does not close."""
    depth = 0
    in_string = escape_next = False
    for k in range(start, len(text)):
        ch = text[k]
        if escape_next:
            escape_next = False
            continue
        if ch == "\\":
            escape_next = True
            continue
        if ch == '"':
            in_string = not in_string
            continue
        if in_string:
            continue
        if ch == opening:
            depth += 1
        elif ch == closing:
            depth -= 1
            if depth == 0:
                return text[start:k + 1]
    return None


def _mistral_compact(text: str) -> tuple[str, Any, int] | None:
    """`_try_parse_compact_args_format`: `[TOOL_CALLS]name[ARGS]{...}` (either `]` optional)."""
    start = text.find(_MISTRAL_MARKER)
    if start == -1:
        return None
    i = start + len(_MISTRAL_MARKER)
    if i < len(text) and text[i] == "]":
        i += 1
    while i < len(text) and text[i].isspace():
        i += 1
    args_pos = text.find("[ARGS", i)
    if args_pos == -1:
        return None
    name = text[i:args_pos].strip()
    if not name:
        return None
    j = args_pos + len("[ARGS")
    if j < len(text) and text[j] == "]":
        j += 1
    while j < len(text) and text[j].isspace():
        j += 1
    if j >= len(text) or text[j] not in "{[":
        return None
    value = _balanced(text, j, text[j], "}" if text[j] == "{" else "]")
    if not value or not _orjson_accepts(value):
        return None
    try:
        arguments = json.loads(value)
    except json.JSONDecodeError:
        return None
    return name, arguments, j + len(value)


def _mistral(text: str, names: set[str]) -> _Found:
    marker = text.find(_MISTRAL_MARKER)
    normal = text[:marker].strip()
    tool_part = text[marker:]
    if _MISTRAL_BOT in tool_part:  # `[TOOL_CALLS] [{...}, ...]`
        array = _balanced(tool_part, tool_part.find(_MISTRAL_BOT) + len(_MISTRAL_BOT) - 1, "[", "]")
        if not array:
            return normal, []
        calls: list[tuple[str, str]] = []
        try:
            parsed = json.loads(array)
            calls = _parse_base_json(parsed if isinstance(parsed, list) else [parsed], names)
        except json.JSONDecodeError:
            pass
        trailing = tool_part[tool_part.find(array) + len(array):].strip()  # first occurrence, as there
        return ((normal + " " + trailing).strip() if trailing else normal), calls
    calls = []
    remaining = tool_part
    while remaining:  # `[TOOL_CALLS]name[ARGS]{...}`, repeated; text between calls is dropped
        compact = _mistral_compact(remaining)
        if not compact:
            break
        name, arguments, consumed = compact
        calls.extend(_parse_base_json({"name": name, "arguments": arguments}, names))
        remaining = remaining[consumed:].strip()
    if not calls:
        return normal, []
    return ((normal + " " + remaining).strip() if remaining else normal), calls


# --- deepseekv3 (deepseekv3_detector.py) ---

_DSV3_BOT = "<｜tool▁calls▁begin｜>"
_DSV3_CALL = re.compile(r"<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>", re.DOTALL)
_DSV3_DETAIL = re.compile(r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)\n```json\n(.*)\n```<｜tool▁call▁end｜>",
                          re.DOTALL)


def _deepseekv3(text: str, names: set[str]) -> _Found:
    normal = text[:text.find(_DSV3_BOT)].strip()
    calls = []
    try:
        for block in _DSV3_CALL.findall(text):
            detail = _DSV3_DETAIL.search(block)
            name, arguments = detail.group(2), json.loads(detail.group(3))  # no match: AttributeError
            calls.extend(_parse_base_json({"name": name, "parameters": arguments}, names))
    except Exception:
        return text, []  # one bad call (no match, bad JSON): the whole text is content, no call
    return normal, calls


@dataclass(frozen=True)
class _Detector:
    has_tool_call: Callable[[str], bool]
    detect_and_parse: Callable[[str, set[str]], _Found]


_QWEN25 = _Detector(lambda text: _QWEN_BOT in text, _qwen25)
# SGLang's names (`FunctionCallParser.ToolCallParserEnum`) for the detectors ported here.
_DETECTORS: dict[str, _Detector] = {
    "deepseekv3": _Detector(lambda text: _DSV3_BOT in text, _deepseekv3),
    "hermes": _Detector(lambda text: _HERMES_BOT in text, _hermes),
    # The tag is optional: a completion that starts with "{" is taken for a call.
    "llama3": _Detector(lambda text: _PYTHON_TAG in text or text.startswith("{"), _llama3),
    "mistral": _Detector(lambda text: _MISTRAL_MARKER in text, _mistral),
    "qwen": _QWEN25,
    "qwen25": _QWEN25,
}

TOOL_CALL_PARSERS: tuple[str, ...] = tuple(sorted(_DETECTORS))

# Where a call may begin in each format, for a streamed answer (`pipeline.serve.live`): content
# is sent only up to the first of these; llama3 also takes a completion that starts with "{".
CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "deepseekv3": (_DSV3_BOT,),
    "hermes": (_HERMES_BOT,),
    "llama3": (_PYTHON_TAG,),
    "mistral": (_MISTRAL_MARKER,),
    "qwen": (_QWEN_BOT,),
    "qwen25": (_QWEN_BOT,),
}
CALL_AT_START: dict[str, str] = {"llama3": "{"}


def tool_names(tools: Iterable[dict[str, Any]]) -> set[str]:
    """The declared function names of OpenAI `tools` (`{"type": "function", "function": {"name": ...}}`)."""
    return {name for tool in tools if (name := (tool.get("function") or {}).get("name"))}


def parse_tool_calls(text: str, tools: list[dict[str, Any]], parser: str) -> tuple[str, list[ToolCall]]:
    """`(content, calls)` of a completion (after any reasoning split), as SGLang's chat handler
    answers with `--tool-call-parser parser`: its `_process_tool_calls` over `FunctionCallParser`.

    No tools, or no marker of the format: the text as it is, no calls. Otherwise the detector's
    normal text (for most formats only what precedes the first call, stripped: text after the calls
    is lost) and the calls to declared tools; calls to other names are dropped. If nothing valid
    is left, no calls and still the detector's normal text. A parse error that SGLang does not catch
    per call (hermes and deepseekv3: any; the others: a call that is not a JSON object) gives the
    text as it is and no calls. tool_choice="none" means no parsing: do not call this."""
    detector = _DETECTORS.get(parser)
    if detector is None:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    names = tool_names(tools)
    if not tools or not detector.has_tool_call(text):
        return text, []
    try:
        normal, found = detector.detect_and_parse(text, names)
    except Exception as exc:  # _process_tool_calls: "Tool call parsing error"
        logger.debug("tool-call parse error (%s): %s", parser, exc)
        return text, []
    return normal, [ToolCall(name, arguments, index) for index, (name, arguments) in enumerate(found)]
