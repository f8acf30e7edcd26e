"""A streamed turn's answer as its tokens come: SSE deltas now, the committed answer's rest at the end.

The worker publishes each sample's tokens as it generates them (`pipeline.core.jobs.turn_stream`);
`LiveTurn` turns them into `chat.completion.chunk` (or `text_completion`) events. It sends only
text the finished answer will begin with:

- the last token is held while it could be a matched stop token (the answer's text leaves one out):
  one of the ids `pipeline.core.stop_tokens` names, the rule the engines stop by (the model's EOS
  ids from its config.json and generation_config.json, the tokenizer's EOS and additional stop
  tokens, the call's `stop_token_ids`); and a trailing incomplete UTF-8 sequence until its next token;
- text from a stop string on is never sent (the answer ends before it), and a tail that could
  still become one is held;
- with a reasoning parser, text goes out as `reasoning_content` or `content` as the parser splits
  it so far; with tools and a tool-call parser, content stops at the first place a call may begin
  (the format's marker; llama3's "{" at the start) and trailing whitespace is held (the parsers
  strip the content before a call). Tool calls come whole, parsed from the committed answer.

When the rows arrive, the answer is the one a non-streamed call gets (`pipeline.serve.answers`,
recorded in the session the same way); what it has beyond what was sent goes out, then each
choice's finish chunk with the row's `token_ids`, `weight_version`, `rollout_id`, and its
logprobs (all of a choice's logprobs in one chunk: the deltas carry token ids only), then usage
when asked and `[DONE]`.

A job that ran again after its worker died streams under a new attempt: a server follows the
newest attempt, and as long as it repeats what was sent (a seeded call does), the stream goes on.
Tokens that differ from what a client already has, or an answer that does not begin with what was
sent, end the stream with an error event (`stream_diverged`) and never a token twice; the turn is
recorded once, from the attempt that committed, and the client's retry of the call gets it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.jobs.turn_stream import TokenDelta
from pipeline.serve.answers import ParseRules
from pipeline.serve.api_error import APIError
from pipeline.serve.parsers import CALL_AT_START, CALL_MARKERS, chat_force_reasoning, parse_reasoning
from pipeline.serve.parsers.reasoning import THINK_END, THINK_START

log = logging.getLogger(__name__)

Decode = Callable[[Sequence[int]], str]


def _sse(data: dict[str, Any]) -> bytes:
    """One server-sent event of `data`."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def error_event(exc: APIError) -> bytes:
    """An error in OpenAI's stream shape (the openai SDK raises it as `APIError`)."""
    return _sse(exc.body())


def _held_tail(text: str, markers: Iterable[str]) -> int:
    """Where the longest tail of `text` that is a proper prefix of a marker begins (len: none)."""
    cut = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, len(text) - k)
                break
    return cut


@dataclass
class TextRules:
    """How a choice's tokens become the text its answer will begin with."""

    decode: Decode | None  # None: no tokenizer (a token-id server): no text until the answer
    stop_ids: frozenset[int]  # tokens that may be a matched stop (left out of the answer's text)
    stops: tuple[str, ...] = ()  # stop strings
    markers: tuple[str, ...] = ()  # parser markers a tail is held back for

    def text(self, ids: Sequence[int]) -> str:
        if self.decode is None:
            return ""
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.decode(ids).rstrip("\ufffd")
        found = [text.find(stop) for stop in self.stops if stop and stop in text]
        if found:
            return text[:min(found)]
        return text[:_held_tail(text, (*self.stops, *self.markers))]


@dataclass
class _Choice:
    index: int
    attempt: int | None = None
    tokens: list[int] = field(default_factory=list)  # the newest attempt's, so far
    shown: int = 0  # tokens whose text was sent (a prefix of every attempt's that goes on)
    shown_ids: list[int] = field(default_factory=list)
    reasoning: str = ""  # sent
    content: str = ""  # sent
    content_closed: bool = False  # a call may have begun: no more content until the answer
    started: bool = False  # the role chunk went out


class LiveTurn:
    """The SSE events of one streamed call: `take` for tokens, `finish` for the committed answer."""

    def __init__(self, *, chat: bool, n: int, text: TextRules, rules: ParseRules | None = None,
                 include_usage: bool = False, head: dict[str, Any]) -> None:
        self.chat = chat
        self.text_rules = text
        self.rules = rules
        self.include_usage = include_usage
        self.head = head  # id, object, created, model
        self.choices = [_Choice(i) for i in range(n)]
        tool_parser = None if rules is None or rules.tool_choice_none or not rules.tools else rules.tool_call_parser
        self.call_markers = CALL_MARKERS.get(tool_parser, ()) if tool_parser else ()
        self.call_at_start = CALL_AT_START.get(tool_parser) if tool_parser else None
        self.tools_active = tool_parser is not None
        if chat and rules is not None:
            think = (THINK_START, THINK_END) if rules.reasoning_parser else ()
            self.text_rules.markers = (*think, *self.call_markers)

    # -- tokens ---------------------------------------------------------------------------------

    def take(self, deltas: Sequence[TokenDelta]) -> list[bytes]:
        """Events for a batch of deltas read together (a backlog is read whole, so a server that
        comes late follows the newest attempt from its start). `APIError` when they contradict what
        was sent."""
        touched: set[int] = set()
        for delta in deltas:
            if delta.sample >= len(self.choices):
                raise APIError(500, f"the turn's token stream names sample {delta.sample} of {len(self.choices)}",
                               code="stream_diverged")
            choice = self.choices[delta.sample]
            if choice.attempt != delta.attempt:
                if delta.offset != 0:
                    continue  # a new attempt is followed from its start
                choice.attempt, choice.tokens = delta.attempt, []
            if delta.offset > len(choice.tokens):
                continue  # a gap (a publish lost): the answer fills it
            choice.tokens[delta.offset:] = list(delta.token_ids)
            touched.add(choice.index)
        events: list[bytes] = []
        for index in sorted(touched):
            choice = self.choices[index]
            common = min(len(choice.tokens), choice.shown)  # a new attempt resumed from an older checkpoint
            if choice.tokens[:common] != choice.shown_ids[:common]:  # may not have caught up yet
                raise APIError(500, f"the worker generating this turn was lost after {choice.shown} tokens were "
                                    "sent and the turn, run again, generated different ones; call again to get its "
                                    "recorded answer", code="stream_diverged")
            events += self._advance(choice)
        return events

    def _advance(self, choice: _Choice) -> list[bytes]:
        ids = choice.tokens
        text = self.text_rules.text(ids)
        delta: dict[str, Any] = {}
        if not self.chat:
            if text.startswith(choice.content) and len(text) > len(choice.content):
                delta["text"] = text[len(choice.content):]
                choice.content = text
        else:
            reasoning, content = self._split(text)
            if reasoning.startswith(choice.reasoning) and len(reasoning) > len(choice.reasoning):
                delta["reasoning_content"] = reasoning[len(choice.reasoning):]
                choice.reasoning = reasoning
            if not choice.content_closed:
                content = self._content_before_calls(choice, content)
                if content.startswith(choice.content) and len(content) > len(choice.content):
                    delta["content"] = content[len(choice.content):]
                    choice.content = content
        if not delta:
            return []
        choice.shown, choice.shown_ids = len(ids), list(ids)
        return [*self._start(choice), self._chunk(choice.index, delta)]

    def _split(self, text: str) -> tuple[str, str]:
        rules = self.rules
        if rules is None or rules.reasoning_parser is None:
            return "", text
        reasoning, rest = parse_reasoning(text, rules.reasoning_parser,
                                          force_reasoning=chat_force_reasoning(rules.reasoning_parser,
                                                                               rules.chat_template_kwargs))
        return reasoning or "", rest

    def _content_before_calls(self, choice: _Choice, content: str) -> str:
        if not self.tools_active:
            return content
        if self.call_at_start is not None and content.startswith(self.call_at_start):
            choice.content_closed = True
            return choice.content
        found = [content.find(m) for m in self.call_markers if m in content]
        if found:
            choice.content_closed = True
            content = content[:min(found)]
        return content.rstrip()

    # -- the answer -----------------------------------------------------------------------------

    def finish(self, answer: dict[str, Any]) -> list[bytes]:
        """The committed answer's events: each choice's rest, its calls and finish; usage; `[DONE]`.
        `APIError` when the answer does not begin with what was sent."""
        self.head = {**self.head, "id": answer["id"], "created": answer["created"]}
        events: list[bytes] = []
        for item in answer["choices"]:
            choice = self.choices[item["index"]]
            if item["token_ids"][:choice.shown] != choice.shown_ids:
                raise APIError(500, "the turn was run again after its worker was lost and its answer differs from "
                                    "what this stream sent; call again to get the recorded answer",
                               code="stream_diverged")
            events += self._start(choice)
            events += self._rest_chat(choice, item) if self.chat else self._rest_text(choice, item)
        if self.include_usage:
            events.append(_sse({**self.head, "choices": [], "usage": answer["usage"]}))
        events.append(b"data: [DONE]\n\n")
        return events

    def _rest(self, field_name: str, sent: str, final: str) -> dict[str, Any]:
        if final.startswith(sent):
            return {field_name: final[len(sent):]} if len(final) > len(sent) else {}
        log.warning("a streamed %s differs from its answer's (sent %r, answer %r)", field_name, sent[-40:],
                    final[:80])
        return {}

    def _rest_chat(self, choice: _Choice, item: dict[str, Any]) -> list[bytes]:
        message = item["message"]
        events = []
        for name, sent in (("reasoning_content", choice.reasoning), ("content", choice.content)):
            rest = self._rest(name, sent, message.get(name) or "")
            if rest:
                events.append(self._chunk(choice.index, rest))
        for call in message.get("tool_calls", []):
            events.append(self._chunk(choice.index, {"tool_calls": [call]}))
        events.append(self._chunk(choice.index, {}, item["finish_reason"], logprobs=item["logprobs"],
                                  matched_stop=item["matched_stop"], rollout_id=item["rollout_id"],
                                  weight_version=item["weight_version"], token_ids=item["token_ids"]))
        return events

    def _rest_text(self, choice: _Choice, item: dict[str, Any]) -> list[bytes]:
        rest = self._rest("text", choice.content, item["text"])
        events = [self._chunk(choice.index, rest)] if rest else []
        events.append(self._chunk(choice.index, {"text": ""}, item["finish_reason"], logprobs=item["logprobs"],
                                  rollout_id=item["rollout_id"], weight_version=item["weight_version"],
                                  token_ids=item["token_ids"]))
        return events

    # -- chunks ---------------------------------------------------------------------------------

    def _start(self, choice: _Choice) -> list[bytes]:
        if choice.started or not self.chat:
            return []
        choice.started = True
        return [self._chunk(choice.index, {"role": "assistant", "content": ""})]

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        logprobs = extra.pop("logprobs", None)
        if self.chat:
            body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, **extra}
        else:
            body = {"index": index, "text": delta.get("text", ""), "logprobs": logprobs, "finish_reason": finish,
                    **extra}
        return _sse({**self.head, "choices": [body]})


def answered_events(answer: dict[str, Any], include_usage: bool) -> list[bytes]:
    """The events of a streamed call answered before (a client's retry): the whole answer at once."""
    chat = answer["object"] == "chat.completion"
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    live = LiveTurn(chat=chat, n=len(answer["choices"]), text=TextRules(None, frozenset()),
                    include_usage=include_usage, head=head)
    return live.finish(answer)
