"""A call to `pipeline serve` as a turn: session, prompt ids by the prefix rule, the lane, the answer.

The prefix rule (multi-turn without drift): when a chat call's messages are the session's last
turn's messages, then an assistant message equal to a choice this server answered (same content,
same tool calls), then new messages, its prompt ids are the last turn's prompt ids + that
choice's completion ids verbatim + the rendering of only what follows
(`ChatRenderer.render_after_reply`). Token-id calls (`/v1/completions`) extend when their ids start
with the last prompt + a choice's completion. Anything else after the first turn (a history the
agent truncated, summarised or edited) is rendered whole and recorded as a prefix break: on the
row, in the session and the run's counts, never silent.

A call equal to the last turn's (a client retrying after a lost answer) gets that answer again;
a call equal to the turn in flight waits for it; each turn is generated once. A call is served
in three steps: `chat`/`completion` (session, prompt, claim, enqueue; a thread), `wait_async`
(the rows, on the event loop), `finish` (the answer, recorded in the session; a thread).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import pyarrow as pa
import redis

from pipeline.core.affinity import DEFAULT_LOAD_FACTOR, Route
from pipeline.core.errors import RenderError
from pipeline.core.jobs import lanes, turn_log
from pipeline.core.jobs.status import read_status
from pipeline.core.jobs.turn_stream import TokenDelta
from pipeline.core.stop_tokens import matched_stop_ids
from pipeline.serve.answers import ParseRules, canonical_assistant, chat_answer, text_answer, turn_rows
from pipeline.serve.api_error import APIError
from pipeline.serve.lane import Lane
from pipeline.serve.live import LiveTurn, TextRules
from pipeline.serve.protocol import DEFAULT_MAX_TOKENS, ChatCompletionBody, CompletionBody
from pipeline.serve.sessions import (
    Choice,
    ConversationDigests,
    Pending,
    Placed,
    Session,
    SessionStore,
    TurnRecord,
    digest,
    ended,
)
from pipeline.serve.turn_counts import TurnCounts
from pipeline.serve.turn_wait import Answered
from pipeline.submit.render import ChatRenderer
from schemas.chat import ChatRequest
from schemas.job_payload import TurnTag
from schemas.request import MAX_PROMPT_TOKENS, RolloutRequest
from schemas.turn_id import TurnId


def _decode(tokenizer: Any, skip_special_tokens: bool, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


@dataclass(frozen=True)
class TurnSettings:
    """What a server was started with that shapes every turn."""

    run: str
    output: str
    pool: str
    model: str
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    context_length: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    turn_timeout_s: float = 600.0
    affinity: bool = True  # a session's turns go to its home worker (`pipeline.core.affinity`)
    load_factor: float = DEFAULT_LOAD_FACTOR
    stop_ids: frozenset[int] = frozenset()  # the model's matched-stop ids (`pipeline.core.stop_tokens`)


@dataclass(frozen=True)
class InFlight:
    """A call whose turn is in the lane: what waiting for it and answering it need."""

    session: Session
    pending: Pending
    started: float
    answer: Callable[[list[dict[str, Any]], Pending], dict[str, Any]]  # the turn's rows (`turn_rows`)
    assistant_of: Callable[[dict[str, Any]], dict[str, Any]]
    settled: Callable[[], dict[str, Any] | None]
    live: Callable[[str], LiveTurn]  # the SSE events (given the turn id) of a streamed call (`pipeline.serve.live`)
    route: Route | None = None  # where this server routed the turn (None: another call enqueued it)


@dataclass(frozen=True)
class Prompt:
    """A turn's prompt: ids for the queue, text for the row, whether it broke the session's prefix."""

    ids: list[int]
    text: str | None
    prefix_break: bool


class Turns:
    """Serves turns of any session of one pool (sessions and the lane are in Redis)."""

    def __init__(self, conn: redis.Redis, settings: TurnSettings, renderer: ChatRenderer | None) -> None:
        self.conn = conn
        self.settings = settings
        self.renderer = renderer
        self.counts = TurnCounts(conn)  # the pool's turn counts, written every half second
        self.sessions = SessionStore(conn, self.counts)
        self.lane = Lane(conn, settings.pool, turn_timeout_s=settings.turn_timeout_s, affinity=settings.affinity,
                         load_factor=settings.load_factor)

    def close(self) -> None:
        """Write the turn counts held here, stop taking answers."""
        self.counts.close()
        self.lane.close()

    # -- sessions -----------------------------------------------------------------------------

    def open_session(self, session_id: str | None, *, create: bool = False) -> Session:
        """The named session (404 if unknown unless `create`, 409 if ended), or a new session of one turn."""
        if session_id is None:
            return self.sessions.create(run=self.settings.run, pool=self.settings.pool, output=self.settings.output,
                                        ephemeral=True)
        if create:
            session = self.sessions.get_or_create(session_id, run=self.settings.run, pool=self.settings.pool,
                                                  output=self.settings.output)
        else:
            session = self.sessions.get(session_id)
        if session.state != "open":
            raise ended(session_id)
        if session.pool != self.settings.pool:
            raise APIError(409, f"session {session_id!r} belongs to pool {session.pool!r}; this server serves pool "
                                f"{self.settings.pool!r}", param="session_id", code="wrong_pool")
        return session

    @contextlib.contextmanager
    def _ended_if_refused(self, session: Session) -> Iterator[None]:
        """A session of one call (no session named) that the call never turns into a turn (refused: too
        long, invalid) is ended at once, not left open."""
        try:
            yield
        except BaseException:
            if session.ephemeral:
                with contextlib.suppress(Exception):
                    self.sessions.end(session.session_id)
            raise

    def _release_failed(self, call: InFlight) -> None:
        """A failed turn: its pending mark goes; a session of one call ends with it."""
        self.sessions.release(call.session, call.pending)
        if call.session.ephemeral:
            self.sessions.end(call.session.session_id)

    # -- tokens -------------------------------------------------------------------------------

    def _tokenizer(self) -> Any:
        if self.renderer is None:
            raise APIError(400, "this server was started without --tokenizer: it serves token ids only "
                                "(POST /v1/completions with a list of ids as the prompt)", code="no_tokenizer")
        return self.renderer.tokenizer

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one Turns per server, tokens are few
    def token_text(self, token_id: int) -> str:
        if self.renderer is None:
            return f"token_id:{token_id}"
        return self.renderer.tokenizer.decode([token_id], skip_special_tokens=False)

    def _text_of(self, row: dict[str, Any], skip_special_tokens: bool = True) -> str:
        """The row's completion text; decoded here (its end-of-turn token left out, as SGLang's
        detokenizer leaves a matched stop token out) when the engine had no tokenizer."""
        if row["completion_text"] is not None:
            return row["completion_text"]
        if self.renderer is None:
            return ""
        ids = row["completion_token_ids"]
        if row["finish_reason"] == "stop" and row["stop_reason_text"] is None and ids:
            ids = ids[:-1]
        return self.renderer.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _special_text(self, ids: list[int]) -> str:
        return self.renderer.tokenizer.decode(ids, skip_special_tokens=False) if self.renderer else ""

    def _text_rules(self, body: ChatCompletionBody | CompletionBody, skip_special_tokens: bool) -> TextRules:
        """How a streamed call's tokens become the text its answer begins with (`pipeline.serve.live`)."""
        if self.renderer is None:
            return TextRules(None, frozenset())
        tokenizer = self.renderer.tokenizer
        stops = () if body.no_stop_trim or body.stop is None else \
            ((body.stop,) if isinstance(body.stop, str) else tuple(body.stop))
        held = matched_stop_ids(self.settings.stop_ids, body.stop_token_ids, ignore_eos=bool(body.ignore_eos))
        return TextRules(functools.partial(_decode, tokenizer, skip_special_tokens), held, stops)

    def _head(self, answer_id: str, kind: str) -> dict[str, Any]:
        return {"id": answer_id, "object": kind, "created": int(time.time()), "model": self.settings.model}

    def _budget(self, prompt: Prompt, asked: int | None) -> int:
        """max_new_tokens for the turn; 400 when the prompt (and what was asked) exceed the context."""
        length, context = len(prompt.ids), self.settings.context_length
        if length > MAX_PROMPT_TOKENS:
            raise APIError(400, f"the prompt has {length} tokens, over the limit of {MAX_PROMPT_TOKENS}",
                           param="messages", code="context_length_exceeded")
        if context is None:
            return asked or self.settings.default_max_tokens
        if length + (asked or 1) > context:
            raise APIError(400, f"this model's maximum context length is {context} tokens; the prompt has {length} "
                                f"tokens" + (f" and max_tokens asks for {asked} more" if asked else "")
                                + "; shorten the conversation or lower max_tokens", param="messages",
                           code="context_length_exceeded")
        return asked or min(self.settings.default_max_tokens, context - length)

    # -- chat ---------------------------------------------------------------------------------

    def chat(self, body: ChatCompletionBody, session_id: str | None, *,
             create: bool = False) -> dict[str, Any] | InFlight:
        """Start a chat turn of `session_id` (None: a session of one turn; `create`: open it if unknown):
        its answer when the call was answered before (a client's retry), else the turn in flight
        (`wait`/`wait_async` for its rows, then `finish`)."""
        self._tokenizer()
        session = self.open_session(session_id, create=create)
        with self._ended_if_refused(session):
            messages = [m.model_dump(mode="json", exclude_none=True) for m in body.messages]
            digests = ConversationDigests(messages)
            # The call's digest (a client's retry is the same call): the conversation's and the rest's.
            request_digest = digest({"messages": digests.whole(), **body.model_dump(
                mode="json", exclude={"stream", "stream_options", "messages"}, exclude_none=True)})
            rules = ParseRules(self.settings.reasoning_parser if body.separate_reasoning else None,
                               self.settings.tool_call_parser,
                               [t.model_dump(mode="json", exclude_none=True) for t in body.tools or []] or None,
                               body.tool_choice == "none", body.chat_template_kwargs)

            def prompt(last: TurnRecord | None) -> Prompt:
                return self._chat_prompt(body, messages, digests, last)

            # SGLang keeps special tokens in the text when tools may be called (tool-call markers often are).
            keep_specials = bool(rules.tools) and not rules.tool_choice_none
            if keep_specials:
                body = body.model_copy(update={"skip_special_tokens": False})

            def live(turn_id: str) -> LiveTurn:
                return LiveTurn(chat=True, n=body.n, text=self._text_rules(body, skip_special_tokens=not keep_specials),
                                rules=rules, include_usage=body.include_usage,
                                head=self._head(f"chatcmpl-{turn_id}", "chat.completion.chunk"))

            def answer(rows: list[dict[str, Any]], pending: Pending) -> dict[str, Any]:
                return chat_answer(rows, turn_id=pending.turn_id, model=self.settings.model,
                                   session_id=session.session_id, turn=pending.turn, rules=rules,
                                   token_text=self.token_text, logprobs=body.logprobs,
                                   text_of=functools.partial(self._text_of, skip_special_tokens=not keep_specials))

            return self._turn(session, body, request_digest, digests.whole(), len(messages), prompt, answer,
                              assistant_of=lambda choice: choice["message"], live=live)

    def _chat_request(self, body: ChatCompletionBody, messages: list[dict[str, Any]]) -> ChatRequest:
        data: dict[str, Any] = {"id": "turn", "messages": messages}
        if body.tools is not None:
            data["tools"] = [t.model_dump(mode="json", exclude_none=True) for t in body.tools]
        if body.tool_choice is not None:
            data["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) \
                else body.tool_choice.model_dump(mode="json")
        if body.chat_template_kwargs is not None:
            data["chat_template_kwargs"] = body.chat_template_kwargs
        return ChatRequest.model_validate(data)

    def _chat_prompt(self, body: ChatCompletionBody, messages: list[dict[str, Any]], digests: ConversationDigests,
                     last: TurnRecord | None) -> Prompt:
        assert self.renderer is not None
        request = self._chat_request(body, messages)
        try:
            if last is not None and last.n_messages + 1 < len(messages) \
                    and digests.first(last.n_messages) == last.messages_digest \
                    and messages[last.n_messages].get("role") == "assistant":
                reply = canonical_assistant(messages[last.n_messages])
                choice = next((c for c in last.choices if c.assistant == reply), None)
                if choice is not None:
                    extension = self.renderer.render_after_reply(request, last.n_messages, choice.completion_text)
                    return Prompt(last.prompt_ids + choice.completion_ids + extension.input_ids,
                                  (last.prompt_text or "") + choice.completion_text + extension.prompt_text, False)
            rendered = self.renderer.render(request)
        except RenderError as exc:
            raise APIError(400, exc.message, param=exc.field, code="render_error") from None
        return Prompt(rendered.input_ids, rendered.prompt_text, last is not None)

    # -- text / token ids ---------------------------------------------------------------------

    def completion(self, body: CompletionBody, session_id: str | None, *,
                   create: bool = False) -> dict[str, Any] | InFlight:
        """Start a token-level turn (`/v1/completions`); see `chat`."""
        session = self.open_session(session_id, create=create)
        with self._ended_if_refused(session):
            if isinstance(body.prompt, str):
                ids = list(self._tokenizer()(body.prompt)["input_ids"])
                text: str | None = body.prompt
            else:
                ids, text = list(body.prompt), None
            request_digest = digest(body.model_dump(mode="json", exclude={"stream", "stream_options"},
                                                    exclude_none=True))

            def prompt(last: TurnRecord | None) -> Prompt:
                extends = last is not None and any(
                    ids[: len(last.prompt_ids) + len(c.completion_ids)] == last.prompt_ids + c.completion_ids
                    and len(ids) > len(last.prompt_ids) + len(c.completion_ids) for c in last.choices)
                return Prompt(ids, text, last is not None and not extends)

            def answer(rows: list[dict[str, Any]], pending: Pending) -> dict[str, Any]:
                return text_answer(rows, turn_id=pending.turn_id, model=self.settings.model,
                                   session_id=session.session_id, turn=pending.turn, text_of=self._text_of,
                                   token_text=self.token_text, logprobs=body.logprobs)

            def live(turn_id: str) -> LiveTurn:
                skip = body.skip_special_tokens is not False
                return LiveTurn(chat=False, n=body.n, text=self._text_rules(body, skip),
                                include_usage=body.include_usage, head=self._head(f"cmpl-{turn_id}", "text_completion"))

            return self._turn(session, body, request_digest, "", 0, prompt, answer,
                              assistant_of=lambda choice: {"role": "assistant", "content": choice["text"]}, live=live)

    # -- the turn -----------------------------------------------------------------------------

    def _turn(self, session: Session, body: ChatCompletionBody | CompletionBody, request_digest: str,
              messages_digest: str, n_messages: int, prompt_of: Callable[[TurnRecord | None], Prompt],
              answer: Callable[[list[dict[str, Any]], Pending], dict[str, Any]],
              assistant_of: Callable[[dict[str, Any]], dict[str, Any]],
              live: Callable[[str], LiveTurn]) -> dict[str, Any] | InFlight:
        started = time.monotonic()
        for _ in range(3):
            if session.last is not None and session.last.request_digest == request_digest:
                return session.last.response  # the client's retry of a call already answered
            pending = session.pending
            if pending is not None and pending.request_digest != request_digest:
                if self._active(pending.turn_id, session.run):
                    raise APIError(409, f"session {session.session_id!r} has turn {pending.turn} in flight; a session "
                                        "takes one call at a time", code="turn_in_flight")
                self.sessions.release(session, pending)
                pending = None
            route = None
            if pending is None:
                started_turn = self._start(session, body, request_digest, messages_digest, n_messages, prompt_of)
                if started_turn is None:  # another server claimed this session's turn meanwhile
                    session = self.sessions.get(session.session_id)
                    continue
                pending, route = started_turn
            return InFlight(session, pending, started, answer, assistant_of,
                            functools.partial(self._recorded, session.session_id, request_digest), live, route)
        raise APIError(409, f"session {session.session_id!r}: another call keeps taking its turn", code="turn_conflict")

    async def wait_async(self, call: InFlight) -> pa.Table | dict[str, Any]:
        """The turn's rows (or its answer, recorded meanwhile by another waiter), on the event loop:
        blocks no thread while the turn is generated."""
        async with self._failed_turn_released(call):
            return await self.lane.wait_async(call.pending.turn_id, call.session.run, call.started, call.settled)

    async def stream_async(self, call: InFlight) -> AsyncIterator[list[TokenDelta] | Answered]:
        """`wait_async` for a streamed call: batches of the turn's tokens as they come, then the rows."""
        async with self._failed_turn_released(call):
            async for item in self.lane.stream_async(call.pending.turn_id, call.session.run, call.started,
                                                     call.settled):
                yield item

    @contextlib.asynccontextmanager
    async def _failed_turn_released(self, call: InFlight) -> AsyncIterator[None]:
        """A turn that failed on its worker releases its session's pending mark (`_release_failed`)."""
        try:
            yield
        except APIError as exc:
            if exc.code == "turn_failed":
                await anyio.to_thread.run_sync(self._release_failed, call)
            raise

    def finish(self, call: InFlight, got: pa.Table | dict[str, Any]) -> dict[str, Any]:
        """The answer of a turn from its rows, recorded in its session."""
        if isinstance(got, dict):
            return got
        rows = turn_rows(got)
        response = call.answer(rows, call.pending)
        self._record(call, rows, response)
        return response

    def _recorded(self, session_id: str, request_digest: str) -> dict[str, Any] | None:
        """The answer of this call if another waiter recorded it meanwhile."""
        last = self.sessions.get(session_id).last
        return last.response if last is not None and last.request_digest == request_digest else None

    def _active(self, turn_id: str, run: str) -> bool:
        """Whether the turn may still be answered: queued or running."""
        job_id, worker = self.lane.job_of(turn_id)
        if worker is not None:  # in a worker's own lane (a dead one's is moved), unless it failed or was answered
            return lanes.turn_failure(self.conn, turn_id) is None and not turn_log.is_logged(self.conn, run, turn_id)
        status = None if job_id is None else read_status(self.conn, job_id)
        return status in (b"queued", b"started", b"scheduled", b"deferred")

    def _start(self, session: Session, body: ChatCompletionBody | CompletionBody, request_digest: str,
               messages_digest: str, n_messages: int,
               prompt_of: Callable[[TurnRecord | None], Prompt]) -> tuple[Pending, Route] | None:
        prompt = prompt_of(session.last)
        sampling = body.sampling(self._budget(prompt, body.budget()))
        turn = session.turns
        turn_id = str(TurnId.new(session.session_id, turn))
        request = RolloutRequest.model_validate({
            "id": f"{session.session_id}:{turn}", "input_ids": prompt.ids,
            "sampling_params": sampling.model_dump(exclude_defaults=True), "logprobs": body.logprobs_k,
            "metadata": session.metadata, **({"prompt_text": prompt.text} if prompt.text is not None else {}),
            "routing_key": session.session_id,  # the worker's server holding the session's prefix
            "adapter": session.adapter,
        })
        pending = Pending(turn, turn_id, request_digest, messages_digest, n_messages, prompt.prefix_break)
        if not self.sessions.claim(session, pending):
            return None
        try:
            route = self.lane.enqueue(request, run=session.run, output=session.output, home=session.home,
                                      turn=TurnTag(turn_id=turn_id, session_id=session.session_id, turn=turn,
                                                   prefix_break=prompt.prefix_break, stream=body.stream,
                                                   reply_to=self.lane.inbox.server_id))
        except BaseException:
            self.sessions.release(session, pending)
            raise
        return pending, route

    def _record(self, call: InFlight, rows: list[dict[str, Any]], response: dict[str, Any]) -> None:
        session, pending, assistant_of = call.session, call.pending, call.assistant_of
        choices = [Choice(row["completion_token_ids"], self._special_text(row["completion_token_ids"]),
                          canonical_assistant(assistant_of(choice)))
                   for row, choice in zip(rows, response["choices"], strict=True)]
        record = TurnRecord(pending.turn, pending.turn_id, pending.request_digest, pending.messages_digest,
                            pending.n_messages, rows[0]["prompt_token_ids"], rows[0]["prompt_text"], choices, response)
        versions = [v for row in rows for v in ([row["weight_version"]] + [s["version"] for s in
                                                                            row["weight_version_segments"] or []])]
        placed = Placed(served_by=rows[0]["worker_id"], routed_to=None if call.route is None else call.route.worker,
                        moved=None if call.route is None else call.route.moved,
                        prompt_tokens=sum(r["prompt_tokens"] for r in rows),
                        cached_tokens=sum(r["cached_tokens"] for r in rows))
        self.sessions.record(session, pending, record, (min(versions), max(versions)), placed)
        if session.ephemeral:
            self.sessions.end(session.session_id)
