"""A verbatim turn's render sees a window of the history, and renders what the whole history renders.

`ChatRenderer.render_after_reply` renders what follows an earlier reply from a window of the
conversation (`pipeline.submit.extension_window`), so a session's late turn costs what an early
one does; the window is audited against the whole history, and a template it does not fit
renders whole.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.submit.extension_window import FIRST_AUDITS, ExtensionWindow, window_positions
from pipeline.submit.render import ChatRenderer
from schemas.chat import ChatMessage, ChatRequest

TOKENIZERS = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizers"

# Qwen3's rule, small: an assistant message after the last user query keeps its reasoning.
_STRIPPING_TEMPLATE = """\
{%- set last = namespace(user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set last.user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if last.user < 0 -%}{{- raise_exception('No user query found in messages.') -}}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{{- '<|system|>' + m.content -}}
{%- elif m.role == 'user' -%}{{- '<|user|>' + m.content -}}
{%- elif m.role == 'tool' -%}{{- '<|tool|>' + m.content -}}
{%- elif m.role == 'assistant' -%}
{{- '<|assistant|>' -}}
{%- if loop.index0 > last.user and m.reasoning_content -%}
{{- '<think>' + m.reasoning_content + '</think>' -}}
{%- endif -%}
{{- m.content -}}
{%- endif -%}
{{- '<|end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}
"""

# A template whose generation prompt counts the messages: what follows a reply depends on the whole history.
_COUNTING_TEMPLATE = """\
{%- for m in messages -%}{{- '<|' + m.role + '|>' + m.content + '<|end|>\n' -}}{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>(' + (messages | length | string) + ')' -}}{%- endif -%}
"""

_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def _tokenizer(tmp_path: Path, name: str, template: str | None = None) -> Any:
    from transformers import AutoTokenizer

    if template is None:
        return AutoTokenizer.from_pretrained(str(TOKENIZERS / name))
    folder = tmp_path / f"{name}-{abs(hash(template))}"
    shutil.copytree(TOKENIZERS / "tiny-tools", folder)
    (folder / "chat_template.jinja").write_text(template)
    return AutoTokenizer.from_pretrained(str(folder))


def _session(shape: str, turns: int) -> list[tuple[list[dict[str, Any]], int]]:
    """Each turn's messages and the index of the reply it extends, for a session of `shape`."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}] if shape != "chat" else []
    messages.append({"role": "user", "content": "Add some numbers."})
    out = []
    for turn in range(turns):
        calls = shape in ("tool loop", "parallel calls") or (shape == "mixed" and turn % 3 != 2)
        reply: dict[str, Any] = {"role": "assistant", "content": f"step {turn}"}
        if calls:
            reply["tool_calls"] = [dict(_CALL, id=f"call_{turn}_{k}") for k in range(2 if shape == "parallel calls"
                                                                                       else 1)]
        messages.append(reply)
        boundary = len(messages) - 1
        if calls:
            messages += [{"role": "tool", "tool_call_id": call["id"], "content": str(turn + k)}
                         for k, call in enumerate(reply["tool_calls"])]
        else:
            messages.append({"role": "user", "content": f"And now {turn}?"})
        out.append(([dict(m) for m in messages], boundary))
    return out


SHAPES = ["chat", "system chat", "tool loop", "parallel calls", "mixed"]


def _counting(tokenizer: Any) -> list[int]:
    """The number of messages of each render the tokenizer's template does from now on."""
    seen: list[int] = []
    apply = tokenizer.apply_chat_template

    def counting(messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        seen.append(len(messages))
        return apply(messages, **kwargs)

    tokenizer.apply_chat_template = counting
    return seen


@pytest.mark.parametrize("template", ["smollm2", "tiny-tools", "stripping"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tools", [False, True])
def test_every_turn_renders_what_the_whole_history_renders(tmp_path: Path, template: str, shape: str,
                                                           tools: bool) -> None:
    """Past its first audits, each turn of a 12-turn session of any shape is rendered once, from its
    window alone, and is what the whole history renders."""
    tokenizer = _tokenizer(tmp_path, "smollm2" if template == "smollm2" else "tiny-tools",
                           _STRIPPING_TEMPLATE if template == "stripping" else None)
    whole = ChatRenderer(tokenizer, ExtensionWindow(audit_every=0))
    windowed = ChatRenderer(tokenizer, ExtensionWindow(audit_every=1000))
    seen = _counting(tokenizer)
    windows = unaudited = 0
    for messages, boundary in _session(shape, 12):
        request = ChatRequest.model_validate({"id": "t", "messages": messages, **({"tools": _TOOLS} if tools else {})})
        completion = f"step {len(messages)}<|end|>\n"
        seen.clear()
        got = windowed.render_after_reply(request, boundary, completion)
        positions = window_positions(request.messages or [], boundary)
        windows += positions is not None
        unaudited += positions is not None and seen == [len(positions)]
        assert got == whole.render_after_reply(request, boundary, completion)
        assert windowed.window.refused(request) is None
    assert windows >= 10 and unaudited == windows - FIRST_AUDITS


def test_a_template_the_window_does_not_fit_is_caught_by_its_first_audit_and_renders_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = _tokenizer(tmp_path, "tiny-tools", _COUNTING_TEMPLATE)
    renderer = ChatRenderer(tokenizer, ExtensionWindow(audit_every=1000))
    whole = ChatRenderer(tokenizer, ExtensionWindow(audit_every=0))
    session = _session("chat", 8)
    with caplog.at_level(logging.WARNING, logger="pipeline.submit.extension_window"):
        for messages, boundary in session:
            request = ChatRequest.model_validate({"id": "t", "messages": messages})
            got = renderer.render_after_reply(request, boundary, "x<|end|>\n")
            assert got == whole.render_after_reply(request, boundary, "x<|end|>\n")
            assert got.prompt_text.endswith(f"<|assistant|>({len(messages)})")
    assert "renders what follows a reply differently" in caplog.text
    assert "the whole history" in (renderer.window.refused(request) or "")


def test_after_its_first_audits_a_window_is_all_the_template_sees(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, "smollm2")
    renderer = ChatRenderer(tokenizer, ExtensionWindow(audit_every=1000))
    seen = _counting(tokenizer)
    for messages, boundary in _session("system chat", FIRST_AUDITS + 30):
        request = ChatRequest.model_validate({"id": "t", "messages": messages})
        seen.clear()
        renderer.render_after_reply(request, boundary, "x")
    assert len(messages) > 60
    assert seen == [4]  # the system prompt, the query before the reply, the reply, the new message


def test_windows_are_audited_first_and_then_every_nth_while_they_are_their_whole_histories() -> None:
    window = ExtensionWindow(audit_every=3)
    request = ChatRequest.model_validate({"id": "t", "messages": [{"role": "user", "content": "x"}]})
    other = ChatRequest.model_validate({"id": "t", "messages": [{"role": "user", "content": "x"}], "tools": _TOOLS})
    due = [window.audit_due(ExtensionWindow.setting(request), 4, 4) for _ in range(FIRST_AUDITS + 6)]
    assert due == [True] * FIRST_AUDITS + [False, False, True] * 2
    assert window.audit_due(ExtensionWindow.setting(other), 4, 4)  # each setting audited from its first window


def test_audits_grow_rarer_as_histories_grow_so_they_cost_a_share_of_the_windows() -> None:
    """A window of 4 messages over a history of 40: the audit renders 10 windows' worth, so it comes once
    the windows since the last one rendered (audit_every - 1) x 40 messages: every 21st window, not 3rd."""
    window = ExtensionWindow(audit_every=3)
    request = ChatRequest.model_validate({"id": "t", "messages": [{"role": "user", "content": "x"}]})
    due = [window.audit_due(ExtensionWindow.setting(request), 4, 40) for _ in range(FIRST_AUDITS + 42)]
    assert due == [True] * FIRST_AUDITS + ([False] * 20 + [True]) * 2
    every = ExtensionWindow(audit_every=1)  # 1: every turn, however long the history
    assert all(every.audit_due(ExtensionWindow.setting(request), 4, 4000) for _ in range(FIRST_AUDITS + 3))


def test_a_window_leaves_out_an_even_number_of_messages_and_keeps_the_query() -> None:
    def window(roles: str) -> str | None:
        names = {"s": "system", "u": "user", "a": "assistant", "A": "assistant", "t": "tool"}
        messages = [ChatMessage(role=names[r], content="x") for r in roles.split()]
        positions = window_positions(messages, roles.split().index("A"))
        return None if positions is None else " ".join(roles.split()[k] for k in positions)

    assert window("u a u a u A u") == "u a u A u"
    assert window("s u a u a A u") == "s u a A u"
    assert window("s u a t a t a t A t") == "s u a t A t"
    assert window("u a u A u") is None  # nothing to leave out
    assert window("s a t a t A t") == "s a t A t"  # no query: the rounds alone
