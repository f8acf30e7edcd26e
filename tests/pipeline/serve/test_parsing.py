"""`pipeline.serve.parsers` against SGLang 0.5.23's own code, loaded from its wheel.

The reference for one choice is what `OpenAIServingChat._build_chat_response` does with a completion
text: its `ReasoningParser` (from `srt/parser/reasoning_parser.py`), then its own methods
`_tool_call_parsing_active`, `_effective_tools`, `_process_tool_calls` (over `FunctionCallParser`,
`srt/function_call/`) and `_get_reasoning_from_request`, compiled from `serving_chat.py`'s source
(importing that module needs the whole server) and run on a stand-in `self` that holds only the
server settings they read. Besides what `tests/helpers/sglang_wheel.py` needs, loading these takes
openai, orjson, partial-json-parser and xgrammar (with apache-tvm-ffi; xgrammar's other
dependencies are not needed).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import json
import logging
import sys
import types
import uuid
import zipfile
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.serve.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ChatAnswer,
    ToolCall,
    chat_force_reasoning,
    parse_chat_answer,
    parse_reasoning,
    parse_tool_calls,
)
from tests.helpers import sglang_wheel

SERVING_CHAT = "sglang/srt/entrypoints/openai/serving_chat.py"
SERVING_METHODS = ("_effective_tools", "_tool_call_parsing_active", "_process_tool_calls", "_process_tool_call_id",
                   "_get_reasoning_from_request")


@functools.cache
def sgl() -> types.SimpleNamespace:
    """SGLang's parser modules and the chat handler's methods, loaded once."""
    sglang_wheel.load()
    wheel = sglang_wheel.wheel_path()
    for name in ("sglang.srt.function_call", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai"):
        sglang_wheel._bare_package(name, wheel)
    if "sglang.utils" not in sys.modules:
        # sglang/utils.py (IPython, requests, pybase64, ...) gives protocol.py one helper, for
        # response formats only: a stand-in that refuses.
        stub = types.ModuleType("sglang.utils")
        stub.convert_json_schema_to_str = sglang_wheel._refuse("response formats")
        sys.modules["sglang.utils"] = stub
    protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
    fcp = importlib.import_module("sglang.srt.function_call.function_call_parser")
    reasoning = importlib.import_module("sglang.srt.parser.reasoning_parser")
    namespace: dict[str, Any] = {
        "Any": Any, "json": json, "orjson": orjson, "uuid": uuid,
        "logger": logging.getLogger("sglang.srt.entrypoints.openai.serving_chat"),
        "envs": importlib.import_module("sglang.srt.environ").envs,
        "FunctionCallParser": fcp.FunctionCallParser,
        "ToolCallItem": importlib.import_module("sglang.srt.function_call.core_types").ToolCallItem,
        "IQuestQ1ReasoningDetector": reasoning.IQuestQ1ReasoningDetector,
        "ChatCompletionMessageGenericParam": protocol.ChatCompletionMessageGenericParam,
        **{name: getattr(protocol, name) for name in ("ChatCompletionRequest", "Tool", "ToolCall", "ToolChoice",
                                                      "FunctionResponse", "ToolCallProcessingResult")},
    }
    return types.SimpleNamespace(protocol=protocol, fcp=fcp, reasoning=reasoning,
                                 methods=_serving_chat_methods(wheel, namespace))


def _serving_chat_methods(wheel: Any, namespace: dict[str, Any]) -> dict[str, Any]:
    """`OpenAIServingChat`'s methods `SERVING_METHODS`, compiled from the wheel's source into
    `namespace`, which must hold every global name they use (checked: a missing one could hide in
    `_process_tool_calls`'s catch-all)."""
    with zipfile.ZipFile(wheel) as archive:
        tree = ast.parse(archive.read(SERVING_CHAT).decode())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "OpenAIServingChat")
    nodes = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name in SERVING_METHODS]
    assert sorted(node.name for node in nodes) == sorted(SERVING_METHODS)
    for node in nodes:
        local = {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)}
        local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local |= {n.name for n in ast.walk(node) if isinstance(n, ast.ExceptHandler) and n.name}
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        missing = used - local - set(namespace) - set(dir(builtins))
        assert not missing, f"{node.name} uses {sorted(missing)}: add them to the namespace"
        node.decorator_list = []
    future = ast.ImportFrom(module="__future__", names=[ast.alias(name="annotations")], level=0)  # as the file has
    module = ast.fix_missing_locations(ast.Module(body=[future, *nodes], type_ignores=[]))
    code = compile(module, SERVING_CHAT, "exec", dont_inherit=True)
    exec(code, namespace)
    return {name: namespace[name] for name in SERVING_METHODS}


# The reasoning switch SGLang reads from a Qwen3 chat template (`template_detection._is_qwen3`).
QWEN3_TEMPLATE_CONFIG = types.SimpleNamespace(toggle_param="enable_thinking", default_enabled=True, special_case=None)


def sglang_server(reasoning_parser: str | None, tool_call_parser: str | None,
                  template_config: Any = None) -> types.SimpleNamespace:
    """A stand-in `self` for the chat handler's methods: the settings they read, and themselves."""
    s = sgl()
    server = types.SimpleNamespace(
        reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
        tokenizer_manager=types.SimpleNamespace(tokenizer=None),
        template_manager=types.SimpleNamespace(force_reasoning=False, reasoning_config=template_config),
        # as in OpenAIServingChat.__init__
        _reasoning_detector=(s.reasoning.ReasoningParser(model_type=reasoning_parser, stream_reasoning=True).detector
                             if reasoning_parser else None),
    )
    for name, method in s.methods.items():
        setattr(server, name, types.MethodType(method, server))
    return server


def sglang_answer(text: str, *, reasoning_parser: str | None = None, tool_call_parser: str | None = None,
                  tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                  template_config: Any = None, finish_reason: str = "stop") -> ChatAnswer:
    """`_build_chat_response`'s lines for one choice, as SGLang runs them."""
    s = sgl()
    server = sglang_server(reasoning_parser, tool_call_parser, template_config)
    request = s.protocol.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                               tools=tools or None, chat_template_kwargs=chat_template_kwargs)
    reasoning_text = None
    tool_calls = None
    finish = {"type": finish_reason, "matched": None}
    if server.reasoning_parser and request.separate_reasoning:
        force_reasoning = server.template_manager.force_reasoning or server._get_reasoning_from_request(request)
        parser = s.reasoning.ReasoningParser(
            model_type=server.reasoning_parser, stream_reasoning=False, force_reasoning=force_reasoning,
            request=request, tokenizer=None, tool_call_parser_active=server._tool_call_parsing_active(request))
        reasoning_text, text = parser.parse_non_stream(text)
    if server._tool_call_parsing_active(request):
        tool_calls, text, finish = server._process_tool_calls(
            text, server._effective_tools(request), finish, request.tool_choice, 0, request._response_parser_prefix,
            False)
    message = s.protocol.ChatMessage(role="assistant", content=text if text else "", tool_calls=tool_calls,
                                     reasoning_content=reasoning_text if reasoning_text else None)
    return ChatAnswer(
        content=message.content, reasoning_content=message.reasoning_content,
        tool_calls=tuple(ToolCall(c.function.name, c.function.arguments, c.index) for c in message.tool_calls or ()),
        finish_reason=finish["type"])


def sglang_tool_calls(text: str, tools: list[dict[str, Any]], parser: str) -> tuple[str, list[ToolCall]]:
    answer = sglang_answer(text, tool_call_parser=parser, tools=tools)
    return answer.content, list(answer.tool_calls)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]
W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {"tz": "CET"}}'
U = '{"name": "launch_rockets", "arguments": {"count": 3}}'
BAD = '{"name": "get_weather", "arguments": {"city": "Paris"'


def dsv3(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


DSV3_BEGIN, DSV3_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
PARIS, CET = '{"city": "Paris"}', '{"tz": "CET"}'

# Per format: (case, completion text after any reasoning).
CASES: dict[str, list[tuple[str, str]]] = {
    "qwen25": [
        ("single", f"<tool_call>\n{W}\n</tool_call>"),
        ("several", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>"),
        ("content before and after", f"Let me look.\n\n<tool_call>\n{W}\n</tool_call>\nDone."),
        ("malformed JSON", f"Hm <tool_call>\n{BAD}\n</tool_call>"),
        ("malformed then valid", f"<tool_call>\n{BAD}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>"),
        ("unknown tool", f"ok\n<tool_call>\n{U}\n</tool_call>"),
        ("unknown and known", f"<tool_call>\n{U}\n</tool_call>\n<tool_call>\n{W}\n</tool_call>"),
        ("no call", "The weather in Paris is fine."),
        ("no newline after tag", f"<tool_call>{W}</tool_call>"),
        ("unclosed", f"<tool_call>\n{W}"),
        ("not an object", "<tool_call>\n[1, 2]\n</tool_call>"),
        ("list of calls", f"<tool_call>\n[{W}, {T}]\n</tool_call>"),
        ("parameters key", '<tool_call>\n{"name": "get_time", "parameters": {"tz": "UTC"}}\n</tool_call>'),
        ("empty arguments", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
        ("no arguments", '<tool_call>\n{"name": "get_time"}\n</tool_call>'),
        ("unicode", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}\n</tool_call>'),
        ("end tag in text", "See </tool_call> there"),
    ],
    "hermes": [
        ("single", f"<tool_call>{W}</tool_call>"),
        ("several", f"<tool_call>{W}</tool_call><tool_call>\n{T}\n</tool_call>"),
        ("content before and after", f"Let me look. <tool_call>{W}</tool_call> Done."),
        ("malformed JSON", f"Hm <tool_call>{BAD}</tool_call>"),
        ("malformed then valid", f"<tool_call>{BAD}</tool_call><tool_call>{T}</tool_call>"),
        ("unknown tool", f"ok <tool_call>{U}</tool_call>"),
        ("unknown and known", f"<tool_call>{U}</tool_call><tool_call>{W}</tool_call>"),
        ("no call", "The weather in Paris is fine."),
        ("unclosed", f"x <tool_call>{W}"),
        ("empty", "<tool_call></tool_call>"),
        ("blank", "<tool_call> </tool_call>"),
        ("not an object", "<tool_call>3</tool_call>"),
        ("list of calls", f"<tool_call>[{W}, {T}]</tool_call>"),
    ],
    "llama3": [
        ("single", f"<|python_tag|>{W}"),
        ("bare JSON", W),
        ("several", f"<|python_tag|>{W};{T}"),
        ("several, spaced", f"<|python_tag|>{W}; {T}"),
        ("content before and after", f"Let me look. <|python_tag|>{W}; and then some"),
        ("malformed JSON", f"<|python_tag|>{BAD}"),
        ("malformed then valid", f"<|python_tag|>{BAD};{T}"),
        ("unknown tool", f"<|python_tag|>{U}"),
        ("unknown and known", f"<|python_tag|>{U};{W}"),
        ("no call", "The weather in Paris is fine."),
        ("JSON later in text", f"Answer: {W}"),
        ("Python dict", "<|python_tag|>{'name': 'get_weather', 'arguments': {'city': 'Rome'}}"),
        ("Python dict with true", "<|python_tag|>{'name': 'get_time', 'arguments': {'dst': True}}"),
        ("JSON true after space", f'<|python_tag|>{W}; {{"name": "get_time", "arguments": {{"dst": true}}}}'),
        ("not an object", f"<|python_tag|>{W};42"),
        ("braces in a string", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "}{"}'),
    ],
    "mistral": [
        ("single", f"[TOOL_CALLS] [{W}]"),
        ("several", f"[TOOL_CALLS] [{W}, {T}]"),
        ("content before and after", f"Let me look. [TOOL_CALLS] [{W}] Done."),
        ("malformed JSON", f"[TOOL_CALLS] [{BAD}]"),
        ("unbalanced", f"[TOOL_CALLS] [{W}"),
        ("unknown tool", f"ok [TOOL_CALLS] [{U}]"),
        ("unknown and known", f"[TOOL_CALLS] [{U}, {W}]"),
        ("no call", "The weather in Paris is fine."),
        ("compact", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
        ("compact several", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'),
        ("compact with content", 'Sure. [TOOL_CALLS]get_time[ARGS]{"tz": "CET"} then more'),
        ("compact unknown", '[TOOL_CALLS]launch[ARGS]{"count": 3}'),
        ("compact NaN", '[TOOL_CALLS]get_weather[ARGS]{"city": NaN}'),
        ("compact lone surrogate", '[TOOL_CALLS]get_weather[ARGS]{"city": "\\ud800"}'),
        ("compact malformed", '[TOOL_CALLS]get_weather[ARGS]{"city": }'),
        ("compact without brackets", '[TOOL_CALLSget_weather[ARGS{"city": "Oslo"}'),
        ("array of arrays", "[TOOL_CALLS] [[1]]"),
        ("bracket in a string", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "a]b\\"]"}}]'),
        ("marker only", "[TOOL_CALLS"),
    ],
    "deepseekv3": [
        ("single", DSV3_BEGIN + dsv3("get_weather", PARIS) + DSV3_END),
        ("several", DSV3_BEGIN + dsv3("get_weather", PARIS) + "\n" + dsv3("get_time", CET) + DSV3_END),
        ("content before and after", "Let me look." + DSV3_BEGIN + dsv3("get_time", "{}") + DSV3_END + " Done."),
        ("malformed JSON", "Hm " + DSV3_BEGIN + dsv3("get_weather", '{"city": ') + DSV3_END),
        ("unknown tool", "ok " + DSV3_BEGIN + dsv3("launch", '{"count": 3}') + DSV3_END),
        ("unknown and known", DSV3_BEGIN + dsv3("launch", "{}") + dsv3("get_time", CET) + DSV3_END),
        ("no call", "The weather in Paris is fine."),
        ("no json fence", DSV3_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n{}<｜tool▁call▁end｜>"),
        ("begin only", "text " + DSV3_BEGIN),
        ("zero arguments", DSV3_BEGIN + dsv3("get_time", "0") + DSV3_END),
    ],
}
CASES["qwen"] = CASES["qwen25"][:3]

TABLE = [pytest.param(parser, text, id=f"{parser}-{case}") for parser, cases in CASES.items() for case, text in cases]


@pytest.mark.parametrize(("parser", "text"), TABLE)
def test_tool_calls_match_sglang(parser: str, text: str) -> None:
    assert parse_tool_calls(text, TOOLS, parser) == sglang_tool_calls(text, TOOLS, parser)


@pytest.mark.parametrize("parser", sorted(CASES))
def test_no_tools_no_parsing(parser: str) -> None:
    text = CASES[parser][0][1]
    assert parse_tool_calls(text, [], parser) == (text, []) == sglang_tool_calls(text, [], parser)


def test_what_sglang_answers() -> None:
    """The behaviours an agent sees, spelled out (all also checked against SGLang above)."""
    call = ToolCall("get_weather", '{"city": "Paris"}', 0)
    # qwen25: the text after the calls is lost; the text before is stripped.
    assert parse_tool_calls(f"Let me look.\n\n<tool_call>\n{W}\n</tool_call>\nDone.", TOOLS, "qwen25") == (
        "Let me look.", [call])
    # Calls to undeclared tools are dropped, and the indexes count the calls kept.
    assert parse_tool_calls(f"<tool_call>\n{U}\n</tool_call>\n<tool_call>\n{W}\n</tool_call>", TOOLS, "qwen25") == (
        "", [call])
    # A marker with nothing valid: no calls, and the content is the text before the marker.
    assert parse_tool_calls(f"Hm <tool_call>\n{BAD}\n</tool_call>", TOOLS, "qwen25") == ("Hm", [])
    # hermes: one malformed call loses all, and the raw text is the content.
    text = f"<tool_call>{BAD}</tool_call><tool_call>{T}</tool_call>"
    assert parse_tool_calls(text, TOOLS, "hermes") == (text, [])
    # llama3: a completion that starts with "{" is a call even without <|python_tag|>.
    assert parse_tool_calls(W, TOOLS, "llama3") == ("", [call])
    # mistral keeps the text after the array, joined with a space.
    assert parse_tool_calls(f"Let me look. [TOOL_CALLS] [{W}] Done.", TOOLS, "mistral") == (
        "Let me look. Done.", [call])


JSON_BITS = ['{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "get_time"}', '{"name": "nope"}',
             '{"name": "get_time", "parameters": {"tz": "x"}}', '{"name": "get_weather", "arguments": {"city": "',
             "{'name': 'get_time', 'arguments': {}}", "[", "]", "{", "}", '"', "\\", ",", ";", " ", "\n", "x", "NaN",
             "[1]", "{}", "null", "é", '"]}']
FRAGMENTS = {  # markers, and whole calls (valid, to undeclared tools, malformed)
    "qwen25": ["<tool_call>\n", "\n</tool_call>", "<tool_call>", "</tool_call>",
               *(f"<tool_call>\n{body}\n</tool_call>" for body in (W, T, U, BAD, f"[{W}, {T}]"))],
    "hermes": ["<tool_call>", "</tool_call>", "<tool_call>\n",
               *(f"<tool_call>{body}</tool_call>" for body in (W, T, U))],
    "llama3": ["<|python_tag|>", '{"name":', W, T, U, BAD],
    "mistral": ["[TOOL_CALLS] [", "[TOOL_CALLS]", "[TOOL_CALLS", "get_weather", "get_time", "[ARGS]", "[ARGS",
                "launch", PARIS, f"[TOOL_CALLS] [{W}, {T}]", f"[TOOL_CALLS] [{U}]", f"[TOOL_CALLS]get_time[ARGS]{CET}"],
    "deepseekv3": [DSV3_BEGIN, DSV3_END, "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "function",
                   "<｜tool▁sep｜>", "get_time", "get_weather", "\n```json\n", "\n```", PARIS,
                   dsv3("get_weather", PARIS), dsv3("get_time", CET), dsv3("launch", "{}"), dsv3("get_time", "{")],
}


@pytest.mark.parametrize("parser", sorted(FRAGMENTS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_tool_calls_match_sglang_on_soup(parser: str, data: st.DataObject) -> None:
    """Random concatenations of the format's markers and JSON pieces."""
    pieces = data.draw(st.lists(st.sampled_from(FRAGMENTS[parser] + JSON_BITS), max_size=12))
    text = "".join(pieces)
    assert parse_tool_calls(text, TOOLS, parser) == sglang_tool_calls(text, TOOLS, parser), text


REASONING_TEXTS = [
    "<think>I should check.</think>\n\nIt is sunny.",
    "<think><think>twice</think>answer",
    "I should check.</think>It is sunny.",
    "It is sunny.",
    "",
    "<think>cut short",
    "<think></think>",
    "<think>\n\n</think>\n\nNo thinking.",
    "Hello <think>late</think> tail",
    "<think>a</think>b</think>c",
    "<think>plan\n<tool_call>\n{}\n</tool_call>",
    "plan <tool_call>x</think>after",
    "</think>",
    " <think>leading space</think>x",
]


@pytest.mark.parametrize("force", [None, False, True])
@pytest.mark.parametrize("parser", REASONING_PARSERS)
@pytest.mark.parametrize("nonempty", [False, True])
def test_reasoning_matches_sglang(parser: str, force: bool | None, nonempty: bool) -> None:
    s = sgl()
    kwargs = {"force_nonempty_content": True} if nonempty else None
    request = s.protocol.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                               chat_template_kwargs=kwargs)
    for text in REASONING_TEXTS:
        ours = parse_reasoning(text, parser, force_reasoning=force, force_nonempty_content=nonempty)
        theirs = s.reasoning.ReasoningParser(parser, stream_reasoning=False, force_reasoning=force,
                                             request=request).parse_non_stream(text)
        assert ours == ((theirs[0] or None), theirs[1]), text


def test_reasoning_rules() -> None:
    assert parse_reasoning("x</think>y", None) == (None, "x</think>y")
    # deepseek-r1 is reasoning until </think>, with or without <think>, and whatever it is told.
    assert parse_reasoning("plan</think>answer", "deepseek-r1", force_reasoning=False) == ("plan", "answer")
    assert parse_reasoning("no tags at all", "deepseek-r1") == ("no tags at all", "")
    # qwen3: without <think> nothing is reasoning unless forced; an unclosed block ends at <tool_call>.
    assert parse_reasoning("plan</think>answer", "qwen3") == (None, "plan</think>answer")
    assert parse_reasoning("plan</think>answer", "qwen3", force_reasoning=True) == ("plan", "answer")
    assert parse_reasoning("<think>plan<tool_call>\n{}", "qwen3") == ("plan", "<tool_call>\n{}")
    # A <think> anywhere starts reasoning at the text's start.
    assert parse_reasoning("Hi <think>a</think>b", "qwen3") == ("Hi <think>a", "b")


@pytest.mark.parametrize("kwargs", [None, {}, {"enable_thinking": True}, {"enable_thinking": False},
                                    {"enable_thinking": None}, {"enable_thinking": 0}, {"thinking": False}])
@pytest.mark.parametrize("template_config", [None, QWEN3_TEMPLATE_CONFIG], ids=["no-switch", "qwen3-template"])
@pytest.mark.parametrize("parser", [*REASONING_PARSERS, None])
def test_chat_force_reasoning_matches_sglang(parser: str | None, template_config: Any,
                                             kwargs: dict[str, Any] | None) -> None:
    if parser == "deepseek-r1" and template_config is not None:
        pytest.skip("a DeepSeek-R1 template has no Qwen3 switch (and its detector forces reasoning anyway)")
    server = sglang_server(parser, None, template_config)
    request = sgl().protocol.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                   chat_template_kwargs=kwargs)
    expected = server.template_manager.force_reasoning or server._get_reasoning_from_request(request)
    assert chat_force_reasoning(parser, kwargs) == expected


def test_qwen3_template_config_is_sglangs() -> None:
    """QWEN3_TEMPLATE_CONFIG is the switch `template_detection._is_qwen3` recognises."""
    with zipfile.ZipFile(sglang_wheel.wheel_path()) as archive:
        tree = ast.parse(archive.read("sglang/srt/parser/template_detection.py").decode())
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_is_qwen3")
    call = next(n for n in ast.walk(func) if isinstance(n, ast.Call))
    assert {k.arg: ast.literal_eval(k.value) for k in call.keywords} == {"toggle_param": "enable_thinking",
                                                                           "default_enabled": True}


REASONING_AND_TOOLS = [
    ("qwen3", "qwen25", "<think>Check the weather.</think>\n\n<tool_call>\n" + W + "\n</tool_call>"),
    ("qwen3", "qwen25", "<think>Check.\n<tool_call>\n" + W + "\n</tool_call>"),
    ("qwen3", "qwen25", "Check first.\n<tool_call>\n" + W + "\n</tool_call>"),
    ("qwen3", "qwen25", "Just words, no tags."),
    ("qwen3", "qwen25", "<think>a</think>\n\nIt is sunny."),
    ("qwen3", "hermes", "<think>x</think><tool_call>" + T + "</tool_call>"),
    ("qwen3", "qwen25", "<think><tool_call>\n" + W + "\n</tool_call></think>after"),
    ("deepseek-r1", "deepseekv3", "Think.</think>Sure." + DSV3_BEGIN + dsv3("get_time", '{"tz": "CET"}') + DSV3_END),
    ("deepseek-r1", "deepseekv3", "Think about " + DSV3_BEGIN + dsv3("get_time", "{}") + DSV3_END),
    ("deepseek-r1", None, "<think>t</think>a"),
    (None, "llama3", W),
    ("qwen3-thinking", "qwen25", "no tags, all reasoning"),
]


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"force_nonempty_content": True}])
@pytest.mark.parametrize(("reasoning_parser", "tool_call_parser", "text"), REASONING_AND_TOOLS)
@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_chat_answer_matches_sglang(reasoning_parser: str | None, tool_call_parser: str | None, text: str,
                                    kwargs: dict[str, Any] | None, finish_reason: str) -> None:
    for tools in (TOOLS, None):
        ours = parse_chat_answer(text, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                                 tools=tools, chat_template_kwargs=kwargs, finish_reason=finish_reason)
        assert ours == sglang_answer(text, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                                     tools=tools, chat_template_kwargs=kwargs, template_config=QWEN3_TEMPLATE_CONFIG
                                     if reasoning_parser and reasoning_parser.startswith("qwen3") else None,
                                     finish_reason=finish_reason)


THINK_BITS = ["<think>", "</think>", "<think>\n", "\n</think>\n\n", "I think", "<tool_call>"]


@pytest.mark.parametrize(("reasoning_parser", "tool_call_parser"), [
    ("qwen3", "qwen25"), ("qwen3", "hermes"), ("qwen3-thinking", "qwen25"), ("deepseek-r1", "deepseekv3"),
    ("deepseek-r1", "llama3"), ("qwen3", "mistral")])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_chat_answer_matches_sglang_on_soup(reasoning_parser: str, tool_call_parser: str, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS[tool_call_parser] + THINK_BITS + JSON_BITS),
                                      max_size=12)))
    kwargs = data.draw(st.sampled_from([None, {"enable_thinking": False}, {"force_nonempty_content": True}]))
    ours = parse_chat_answer(text, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser, tools=TOOLS,
                             chat_template_kwargs=kwargs)
    template = QWEN3_TEMPLATE_CONFIG if reasoning_parser.startswith("qwen3") else None
    assert ours == sglang_answer(text, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                                 tools=TOOLS, chat_template_kwargs=kwargs, template_config=template), text


def test_qwen3_default_is_forced_reasoning() -> None:
    """SGLang's chat handler forces qwen3's reasoning unless the request turns thinking off: a
    completion without tags is all reasoning, and the content is empty."""
    assert parse_chat_answer("Just words.", reasoning_parser="qwen3") == ChatAnswer("", "Just words.", (), "stop")
    assert parse_chat_answer("Just words.", reasoning_parser="qwen3",
                             chat_template_kwargs={"enable_thinking": False}) == ChatAnswer("Just words.", None, (),
                                                                                            "stop")


def test_parser_names() -> None:
    s = sgl()
    detectors = {"qwen25": "Qwen25Detector", "qwen": "Qwen25Detector", "hermes": "HermesDetector",
                 "llama3": "Llama32Detector", "mistral": "MistralDetector", "deepseekv3": "DeepSeekV3Detector"}
    assert {name: s.fcp.FunctionCallParser.ToolCallParserEnum[name].__name__ for name in TOOL_CALL_PARSERS} == detectors
    assert {name: s.reasoning.ReasoningParser.DetectorMap[name].__name__ for name in REASONING_PARSERS} == {
        "deepseek-r1": "DeepSeekR1Detector", "qwen3": "Qwen3Detector", "qwen3-thinking": "Qwen3Detector"}
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'qwen3_coder'; known: .*qwen25"):
        parse_tool_calls("x", TOOLS, "qwen3_coder")
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'kimi'; known: deepseek-r1, qwen3"):
        parse_reasoning("x", "kimi")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        chat_force_reasoning("glm45")
    assert parse_reasoning("<think>a</think>b", "Qwen3") == ("a", "b")  # looked up lower-cased, as SGLang does
