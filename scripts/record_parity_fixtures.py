"""Records tests/fixtures/parity/<tokenizer>.json from the reference path; regenerate only on purpose.

The reference is transformers' `apply_chat_template` fed by a line-by-line port of SGLang's
message preparation (0.5.x `srt/entrypoints/openai/serving_chat.py` and `protocol.py`, the
plain Jinja path), written here independently of `pipeline.submit.render`: nothing of `pipeline` is
imported, and the content-format detection is SGLang's own, loaded from its wheel by
`tests.helpers.sglang_wheel`. The parity test (tests/pipeline/submit/test_chat_parity.py) checks
`pipeline.submit.render` against these files, and re-records them to check they are reproducible. Each case records the
request line, the prompt text, the token ids with their count and sha256, or SGLang's reason
for rejecting the request. A case where the pipeline knowingly differs carries `known_gap`.

    .venv/bin/python scripts/record_parity_fixtures.py            # both tokenizers
    .venv/bin/python scripts/record_parity_fixtures.py --build-tiny-tokenizer   # rebuild tiny-tools first

`token_sha256` is the sha256 of the ids written as decimal numbers joined by ",".
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import string
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOKENIZERS = FIXTURES / "tokenizers"
PARITY = FIXTURES / "parity"

GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")


class Rejected(Exception):
    """SGLang would answer 400 with this reason."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def token_sha256(ids: list[int]) -> str:
    return hashlib.sha256(",".join(str(i) for i in ids).encode()).hexdigest()


# ---------------------------------------------------------------------------------------
# The tiny tool-aware tokenizer (char-level, BOS added on encode)


def build_tiny_tokenizer(target: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
                "<tools>", "</tools>", "<sys_tools>", "</sys_tools>", "<tool_call>", "</tool_call>",
                "<think>", "</think>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                             special_tokens=[("<s>", vocab["<s>"])])
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|end|>",
        "unk_token": "<unk>", "pad_token": "</s>", "model_max_length": 4096,
    }, indent=2) + "\n")


# ---------------------------------------------------------------------------------------
# The reference: SGLang's request model and serving_chat, ported for plain dicts


def _function_dump(function: dict[str, Any]) -> dict[str, Any]:
    """protocol.Function's serializer: fields, unset strict/defer_loading dropped, client order first."""
    data = {"description": function.get("description"), "name": function["name"],
            "parameters": function.get("parameters"), "strict": function.get("strict"),
            "defer_loading": function.get("defer_loading")}
    if data["defer_loading"] is None:
        data.pop("defer_loading")
    if data["strict"] is None:
        data.pop("strict")
    order = list(function)
    rest = [k for k in data if k not in order]
    return {k: data[k] for k in order + rest if k in data}


def _tool_dump(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": tool.get("type", "function"), "function": _function_dump(tool["function"]),
            "defer_loading": tool.get("defer_loading")}


def _message_dump(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """ChatCompletionMessageParam validation + model_dump (pydantic ignores unknown keys)."""
    role = message.get("role")
    if role == "user":
        if message.get("content") is None:
            raise Rejected(f"messages[{index}]", "user content")
        content = message["content"]
        return {"role": "user", "content": copy.deepcopy(content)}
    if not isinstance(role, str) or role.lower() not in GENERIC_ROLES:
        raise Rejected(f"messages[{index}].role", "'role' must be")
    role = role.lower()
    content = copy.deepcopy(message.get("content"))
    if role != "assistant" and isinstance(content, list) and any(
            part.get("type") in ("thinking", "reasoning") for part in content):
        raise Rejected(f"messages[{index}]", "thinking content parts are only valid in assistant messages")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        tool_calls = [{"id": c.get("id"), "index": c.get("index"), "type": c.get("type", "function"),
                       "function": {"name": c["function"].get("name"),
                                    "arguments": c["function"].get("arguments")}} for c in tool_calls]
    tools = message.get("tools")
    return {"role": role, "content": content, "tool_call_id": message.get("tool_call_id"),
            "name": message.get("name"), "phase": None, "reasoning_content": message.get("reasoning_content"),
            "tool_calls": tool_calls, "tools": None if tools is None else [_tool_dump(t) for t in tools],
            "prefix": None}


def _effective_tools(request: dict[str, Any]) -> list[dict[str, Any]]:
    tools = list(request.get("tools") or [])
    for message in request["messages"]:
        if isinstance(message.get("role"), str) and message["role"].lower() in ("root", "system", "developer"):
            tools.extend(message.get("tools") or [])
    return tools


def _validate_request(request: dict[str, Any]) -> None:
    """serving_chat._validate_request, the text-only checks."""
    if not request.get("messages"):
        raise Rejected("messages", "Messages cannot be empty.")
    if request.get("chat_template_kwargs") and "chat_template" in request["chat_template_kwargs"]:
        raise Rejected("chat_template_kwargs.chat_template", "Request-supplied chat_template is not allowed")
    tools = _effective_tools(request)
    choice = request["tool_choice"]
    if isinstance(choice, str) and choice.lower() == "required" and not tools:
        raise Rejected("tool_choice", "Tools cannot be empty if tool choice is set to required.")
    if not isinstance(choice, str):
        if not tools:
            raise Rejected("tool_choice", "Tools cannot be empty if tool choice is set to a specific tool.")
        name = choice["function"]["name"]
        if not any(t["function"]["name"] == name for t in tools):
            raise Rejected("tool_choice.function.name", f"Tool '{name}' not found in tools list.")
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    for i, tool in enumerate(tools):
        if tool["function"].get("parameters") is None:
            continue
        try:
            Draft202012Validator.check_schema(tool["function"]["parameters"])
        except SchemaError:
            raise Rejected("tools", f"Tool {i} function has invalid 'parameters' schema") from None


def _process_content(msg: dict[str, Any], fmt: str) -> dict[str, Any]:
    """jinja_template_utils.process_content_for_template_format, text parts only."""
    if not isinstance(msg.get("content"), list):
        return {k: v for k, v in msg.items() if v is not None}
    if fmt == "openai":
        parts = [{"type": "text", "text": c["text"]} for c in msg["content"]
                 if isinstance(c, dict) and c.get("type") in ("text", "input_text")]
        new = {k: v for k, v in msg.items() if v is not None and k != "content"}
        new["content"] = parts
        return new
    texts = [c["text"] for c in msg["content"] if isinstance(c, dict) and c.get("type") in ("text", "input_text")]
    new = msg.copy()
    new["content"] = " ".join(texts) if texts else ""
    return {k: v for k, v in new.items() if v is not None}


def _normalize_tool_content(role: str, content: Any) -> Any:
    if role != "tool" or not isinstance(content, list):
        return content
    if all((isinstance(p, dict) and p.get("type") == "text") or isinstance(p, str) for p in content):
        return " ".join(p.get("text", "") if isinstance(p, dict) else p for p in content)
    return content


def reference_render(tokenizer: Any, request: dict[str, Any]) -> tuple[str, list[int]]:
    """(prompt text, ids) as SGLang's chat endpoint computes them, or `Rejected`."""
    from tests.helpers.sglang_wheel import jinja_content_format  # SGLang's own code, from its wheel

    request = copy.deepcopy(request)
    if request.get("tool_choice") is None:
        has_message_tools = any(isinstance(m.get("role"), str) and m["role"].lower() in ("root", "system", "developer")
                                and m.get("tools") for m in request.get("messages") or [])
        request["tool_choice"] = "none" if request.get("tools") is None and not has_message_tools else "auto"
    messages = [_message_dump(i, m) for i, m in enumerate(request.get("messages") or [])]
    _validate_request(request)
    # _process_messages: the tools the template sees.
    tools = None
    choice = request["tool_choice"]
    if _effective_tools(request) and choice != "none":
        if not isinstance(choice, str):
            tools = [_tool_dump(t) for t in request.get("tools") or []
                     if t["function"]["name"] == choice["function"]["name"]] or None
        elif request.get("tools"):
            tools = [_tool_dump(t) for t in request["tools"]]
    # _apply_jinja_template.
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                if isinstance(call["function"].get("arguments"), str):
                    try:
                        parsed = json.loads(call["function"]["arguments"])
                    except ValueError:
                        raise Rejected(f"messages[{i}]", "Assistant tool call function.arguments must be valid "
                                       "JSON.") from None
                    if not isinstance(parsed, dict):
                        raise Rejected(f"messages[{i}]", "must be a JSON object.")
                    call["function"]["arguments"] = parsed
    fmt = jinja_content_format(tokenizer.chat_template)
    prepared = []
    for msg in copy.deepcopy(messages):
        if msg.get("content") is None:
            msg["content"] = ""
        processed = _process_content(msg, fmt)
        processed["content"] = _normalize_tool_content(processed["role"], processed.get("content"))
        prepared.append(processed)
    prefix = None
    if prepared and prepared[-1].get("role") == "assistant" and isinstance(prepared[-1].get("content"), str):
        if request.get("continue_final_message"):
            prefix = prepared[-1]["content"]
            prepared = prepared[:-1]
        else:
            prepared[-1] = {"role": "user", "content": prepared[-1]["content"]}
    kwargs = dict(request.get("chat_template_kwargs") or {})
    auto_adds = len(tokenizer.encode("")) > 0
    encode_kwargs = {"add_special_tokens": False} if auto_adds else {}

    def render(tools_now: Any) -> str:
        return tokenizer.apply_chat_template(prepared, tokenize=False, add_generation_prompt=True, tools=tools_now,
                                             return_dict=False, **kwargs)

    try:
        text = render(tools)
    except Exception:
        flat = [t.get("function", t) for t in tools] if tools else None
        try:
            text = render(flat)
        except Exception as exc:
            raise Rejected("messages", str(exc)) from None
    ids = list(tokenizer.encode(text, **encode_kwargs))
    if prefix:
        encoded = list(tokenizer.encode(prefix))
        if encoded and encoded[0] == tokenizer.bos_token_id:
            encoded = encoded[1:]
        ids += encoded
        text += prefix
    return text, ids


def reference_continuation(tokenizer: Any, request: dict[str, Any], boundary: int) -> tuple[str, list[int]]:
    """Earlier ids verbatim, then the reference encoding of the rest of the full rendering."""
    earlier = dict(request, messages=request["messages"][:boundary], continue_final_message=False)
    earlier.pop("continue_from")
    earlier_text, earlier_ids = reference_render(tokenizer, earlier)
    assert earlier_ids == request["continue_from"]["prompt_token_ids"], "case built with the wrong prompt ids"
    full = {k: v for k, v in request.items() if k != "continue_from"}
    full_text, _ = reference_render(tokenizer, full)
    completion = request["continue_from"]["completion_token_ids"]
    done = earlier_text + tokenizer.decode(completion, skip_special_tokens=False)
    if not full_text.startswith(done):
        raise Rejected("continue_from", "not an extension")
    auto_adds = len(tokenizer.encode("")) > 0
    rest = full_text[len(done):]
    rest_ids = list(tokenizer.encode(rest, **({"add_special_tokens": False} if auto_adds else {}))) if rest else []
    return full_text, earlier_ids + completion + rest_ids


# ---------------------------------------------------------------------------------------
# The cases, one per rule


def _line(**fields: Any) -> dict[str, Any]:
    return {"id": "case", "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, **fields}


WEATHER = {"type": "function", "function": {
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "name": "get_weather", "description": "Weather in a city"}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def smollm2_cases(tokenizer: Any) -> list[dict[str, Any]]:
    user = {"role": "user", "content": "What is the capital of France?"}
    cases: list[dict[str, Any]] = [
        {"name": "generation_prompt", "rule": "one user message; the generation prompt is added",
         "request": _line(messages=[user])},
        {"name": "system_multiturn", "rule": "system, user, assistant, user",
         "request": _line(messages=[{"role": "system", "content": "Be brief."}, user,
                                    {"role": "assistant", "content": "Paris."},
                                    {"role": "user", "content": "And Spain?"}])},
        {"name": "content_parts_joined", "rule": "text parts joined with ' ' for a string-content template",
         "request": _line(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                   {"type": "text", "text": "world"}]}])},
        {"name": "null_content", "rule": "null assistant content renders as ''",
         "request": _line(messages=[user, {"role": "assistant", "content": None}, {"role": "user", "content": "?"}])},
        {"name": "role_case", "rule": "roles other than user are matched case-insensitively",
         "request": _line(messages=[{"role": "SYSTEM", "content": "Be brief."}, user])},
        {"name": "final_assistant_to_user", "rule": "a final assistant message becomes a user message",
         "request": _line(messages=[user, {"role": "assistant", "content": "The capital is"}])},
        {"name": "continue_final_message", "rule": "render without the final assistant message, append its ids",
         "request": _line(messages=[user, {"role": "assistant", "content": "The capital is"}],
                          continue_final_message=True)},
        {"name": "continue_final_message_bos_dropped",
         "rule": "the appended ids lose a leading BOS (SmolLM2's BOS is <|im_start|>)",
         "request": _line(messages=[user, {"role": "assistant", "content": "<|im_start|>think"}],
                          continue_final_message=True)},
        {"name": "prompt_text", "rule": "prompt text is encoded as /generate encodes text",
         "request": _line(prompt="Once upon a time")},
        {"name": "reject_empty_messages", "rule": "SGLang rejects an empty message list",
         "request": _line(messages=[])},
        {"name": "reject_user_role_case", "rule": "'User' is not a role (only 'user' matches exactly)",
         "request": _line(messages=[{"role": "User", "content": "hi"}])},
        {"name": "reject_user_null_content", "rule": "a user message needs content",
         "request": _line(messages=[{"role": "user", "content": None}])},
        {"name": "reject_request_template", "rule": "a request-supplied chat_template is refused",
         "request": _line(messages=[user], chat_template_kwargs={"chat_template": "{{ 'x' }}"})},
        {"name": "unknown_message_field", "rule": "unknown message fields",
         "request": _line(messages=[{"role": "user", "content": "hi", "weight": 1}]),
         "known_gap": "SGLang ignores unknown message fields; the pipeline rejects them, as every unknown field "
                      "on a request line, so a typo never silently does nothing"},
    ]
    # Two turns: the first turn's ids as a worker would have sampled them (a non-canonical split
    # included, "Par" + "is"), kept verbatim.
    first = [{"role": "system", "content": "Be brief."}, user]
    _, first_ids = reference_render(tokenizer, _line(messages=first))
    sampled = [*tokenizer.encode("Par"), *tokenizer.encode("is."), tokenizer.eos_token_id]
    convo = [*first, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    cases.append({"name": "continue_from_row", "rule": "earlier prompt + completion ids verbatim, then the extension",
                  "boundary": 2, "request": _line(messages=convo, continue_from={
                      "prompt_token_ids": first_ids, "completion_token_ids": sampled})})
    wrong = [*first, {"role": "assistant", "content": "Madrid."}, {"role": "user", "content": "And Spain?"}]
    cases.append({"name": "continue_from_wrong_reply", "rule": "the reply must render as the sampled completion",
                  "request": _line(messages=wrong, continue_from={
                      "prompt_token_ids": first_ids, "completion_token_ids": sampled}),
                  "expected_error": {"field": "messages[2].content", "contains": "does not start with the sampled"}})
    return cases


def tiny_tools_cases(tokenizer: Any) -> list[dict[str, Any]]:
    user = {"role": "user", "content": "Weather in Oslo?"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]}
    result = {"role": "tool", "tool_call_id": "c1",
              "content": [{"type": "text", "text": "4C"}, {"type": "text", "text": "rain"}]}
    cases: list[dict[str, Any]] = [
        {"name": "tools_auto", "rule": "tools given, tool_choice defaults to auto: all tools, client key order",
         "request": _line(messages=[user], tools=[WEATHER, CLOCK])},
        {"name": "tool_choice_none", "rule": "tool_choice none: the template sees no tools",
         "request": _line(messages=[user], tools=[WEATHER, CLOCK], tool_choice="none")},
        {"name": "tool_choice_named", "rule": "a named tool_choice: only that tool",
         "request": _line(messages=[user], tools=[WEATHER, CLOCK],
                          tool_choice={"type": "function", "function": {"name": "get_time"}})},
        {"name": "tool_choice_required", "rule": "tool_choice required: all tools",
         "request": _line(messages=[user], tools=[WEATHER], tool_choice="required")},
        {"name": "tool_call_round_trip", "rule": "tool-call arguments parsed from JSON; tool text parts joined",
         "request": _line(messages=[user, call, result], tools=[WEATHER])},
        {"name": "content_parts_kept", "rule": "a template looping over content gets the text parts",
         "request": _line(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}])},
        {"name": "reasoning", "rule": "reasoning_content reaches the template; thinking parts never do",
         "request": _line(messages=[user, {"role": "assistant", "reasoning_content": "cold?",
                                           "content": [{"type": "thinking", "thinking": "hidden"},
                                                       {"type": "text", "text": "Cold."}]},
                                    {"role": "user", "content": "Thanks"}])},
        {"name": "chat_template_kwargs", "rule": "chat_template_kwargs reach the template",
         "request": _line(messages=[user], chat_template_kwargs={"enable_thinking": True})},
        {"name": "continue_final_message_bos", "rule": "appended ids without the BOS the tokenizer adds",
         "request": _line(messages=[user, {"role": "assistant", "content": "It is"}], continue_final_message=True)},
        {"name": "system_tools", "rule": "tools on a system message: tool_choice auto, rendered by the message",
         "request": _line(messages=[{"role": "system", "content": "S", "tools": [CLOCK]}, user])},
        {"name": "reject_required_without_tools", "rule": "tool_choice required needs tools",
         "request": _line(messages=[user], tool_choice="required")},
        {"name": "reject_named_without_tools", "rule": "a named tool_choice needs tools",
         "request": _line(messages=[user], tool_choice={"type": "function", "function": {"name": "get_time"}})},
        {"name": "reject_named_unknown", "rule": "a named tool_choice must name a tool",
         "request": _line(messages=[user], tools=[WEATHER],
                          tool_choice={"type": "function", "function": {"name": "nope"}})},
        {"name": "reject_bad_arguments", "rule": "tool-call arguments must be a JSON object",
         "request": _line(messages=[user, {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]},
             {"role": "user", "content": "?"}])},
        {"name": "reject_bad_schema", "rule": "tool parameters must be a valid JSON Schema",
         "request": _line(messages=[user], tools=[{"type": "function", "function": {
             "name": "f", "parameters": {"type": 12}}}])},
        {"name": "reject_template_error", "rule": "a template's raise_exception rejects the request",
         "request": _line(messages=[{"role": "developer", "content": "x"}, user])},
    ]
    _, first_ids = reference_render(tokenizer, _line(messages=[user]))
    sampled = [*tokenizer.encode("Rain.", add_special_tokens=False), tokenizer.eos_token_id]
    convo = [user, {"role": "assistant", "content": "Rain."}, {"role": "user", "content": "Tomorrow?"}]
    cases.append({"name": "continue_from_row", "rule": "a two-turn continuation keeps the sampled ids",
                  "boundary": 1, "request": _line(messages=convo, continue_from={
                      "prompt_token_ids": first_ids, "completion_token_ids": sampled})})
    _, tool_ids = reference_render(tokenizer, _line(messages=[user], tools=[WEATHER]))
    cases.append({"name": "continue_from_not_prefix_stable",
                  "rule": "tools move to the last user message: not an extension, said so",
                  "request": _line(messages=convo, tools=[WEATHER], continue_from={
                      "prompt_token_ids": tool_ids, "completion_token_ids": sampled}),
                  "expected_error": {"field": "continue_from", "contains": "not render the conversation as an "
                                                                           "extension"}})
    return cases


# Substrings of our messages for the reference's rejections whose SGLang text is a pydantic error.
_ERROR_TEXT = {"user content": "needs content", "'role' must be": "'role' must be"}


def record(name: str, tokenizer: Any, cases: list[dict[str, Any]]) -> dict[str, Any]:
    recorded = []
    for case in cases:
        case = dict(case)
        boundary = case.pop("boundary", None)
        if "expected_error" in case:
            recorded.append(case)
            continue
        try:
            if "prompt" in case["request"]:  # /generate text: the tokenizer's own special tokens added
                text = case["request"]["prompt"]
                ids = list(tokenizer(text)["input_ids"])
            elif boundary is not None:
                text, ids = reference_continuation(tokenizer, case["request"], boundary)
            else:
                text, ids = reference_render(tokenizer, case["request"])
        except Rejected as exc:
            case["expected_error"] = {"field": exc.field, "contains": _ERROR_TEXT.get(exc.reason, exc.reason)}
        else:
            case["expected"] = {"prompt_text": text, "token_count": len(ids), "token_sha256": token_sha256(ids),
                                "token_ids": ids}
        recorded.append(case)
    import transformers

    return {"tokenizer": name, "recorded_with": {"transformers": transformers.__version__,
                                                 "reference": "SGLang 0.5.x serving_chat, plain Jinja path"},
            "token_sha256": "sha256 of the ids as decimal numbers joined by ','", "cases": recorded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-tiny-tokenizer", action="store_true")
    parser.add_argument("--output", type=Path, default=PARITY, help="fixtures directory (default: %(default)s)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    if args.build_tiny_tokenizer:
        build_tiny_tokenizer(TOKENIZERS / "tiny-tools")
    args.output.mkdir(parents=True, exist_ok=True)
    for name, build in (("smollm2", smollm2_cases), ("tiny-tools", tiny_tools_cases)):
        tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZERS / name))
        fixture = record(name, tokenizer, build(tokenizer))
        (args.output / f"{name}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.output / f'{name}.json'}: {len(fixture['cases'])} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
