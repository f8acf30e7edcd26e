"""A call to `pipeline serve` as a call of its session's tree: prompt ids, placement, dispatch, the answer.

A session is a tree of calls (`pipeline.serve.sessions`), any number in flight at once. A call is
placed under the earlier call it extends, and its prompt ids extend that call's ids verbatim:

- a chat call, in the `verbatim` history mode (the default), extends the call whose conversation and
  one of whose choices (same content, same tool calls) its messages begin with (the longest such):
  its prompt ids are that call's prompt ids + that choice's completion ids + the rendering of only
  what follows (`ChatRenderer.render_after_reply`), so earlier samples are never re-tokenized;
- a chat call in the `template` mode is rendered whole, as the chat template renders it (e.g. earlier
  reasoning stripped), and extends the committed choice whose prompt + completion ids its ids begin
  with (the longest), if any;
- a token-id call (`/v1/completions`) extends the committed choice whose ids its prompt begins with.

A call that extends none is a root: a sub-agent's first call, a conversation restarted from a summary,
a history the agent (or, in `template` mode, the template) rewrote. A root started after the session's
first committed call is counted as a prefix break: on the row, in the session and the run's counts,
never silent.

A retry is answered once: a call whose body equals the latest such call of its session, committed or
in flight, gets that call's answer (or waits for it) instead of generating again. A client that says
whether a call is a retry is taken at its word: the openai SDK's `x-stainless-retry-count` (0: a new
call, even if identical to an earlier one; more: a retry) and an `Idempotency-Key` (the same key is the
same call). A call is served in three steps, each on the server's event loop (its Redis scripts
awaited on an asyncio client; no thread on the way of a turn): `chat`/`completion` (session, prompt,
claim, enqueue), `wait_async` (the rows), `finish` (the answer, recorded in the session).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pyarrow as pa
import redis

from pipeline.core.affinity import DEFAULT_LOAD_FACTOR, Route
from pipeline.core.errors import RenderError
from pipeline.core.jobs.turn_stream import TokenDelta
from pipeline.core.stop_tokens import matched_stop_ids
from pipeline.core.suggest import did_you_mean, listing
from pipeline.serve.answers import ParseRules, canonical_assistant, chat_answer, text_answer, turn_rows
from pipeline.serve.api_error import APIError
from pipeline.serve.conversation import Conversation, Conversations, digest
from pipeline.serve.dispatch import TurnDispatch
from pipeline.serve.live import LiveTurn, TextRules
from pipeline.serve.protocol import DEFAULT_MAX_TOKENS, ChatCompletionBody, CompletionBody
from pipeline.serve.routing import REREAD_S
from pipeline.serve.sessions import (
    MAX_CALLS,
    Choice,
    Opened,
    Parent,
    Pending,
    Placed,
    Session,
    SessionStore,
    TurnRecord,
)
from pipeline.serve.turn_counts import TurnCounts
from pipeline.serve.turn_wait import Answered
from pipeline.submit.render import ChatRenderer
from pipeline.submit.request_file import ParsedRequest
from schemas.adapters import ADAPTER_NAME_PATTERN
from schemas.chat import ChatRequest
from schemas.job_payload import TurnTag
from schemas.request import MAX_PROMPT_TOKENS

ADAPTER_NAME = re.compile(ADAPTER_NAME_PATTERN)
# A chat call's parent is looked for among its latest replies in the read that starts it (almost always the
# latest: an agent's next call), further back in a second read; a long conversation's call sends Redis
# a few keys, not one per earlier reply.
NEAREST_REPLIES = 4
TYPO_CUTOFF = 0.8  # a `model` this close to an adapter's name (difflib's ratio) is taken for a typo of it


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
    history: str = "verbatim"  # a session's history mode unless it names its own (`sessions.HISTORY_MODES`)
    max_session_calls: int = MAX_CALLS


@dataclass(frozen=True)
class CallIdentity:
    """What makes two calls the same call: the digest of their bodies (or of the client's idempotency
    key), and whether a call of that digest already made stands for this one (a retry)."""

    digest: str
    retry: bool

    @classmethod
    def of(cls, body_digest: str, *, idempotency_key: str | None = None,
           retry_count: str | None = None) -> CallIdentity:
        """A call's identity from its body and its client's headers: an `Idempotency-Key` names the call;
        an `x-stainless-retry-count` (the openai SDK's) says whether it is a retry; without either, a
        call identical to an earlier one is taken for its retry."""
        if idempotency_key is not None:
            return cls(digest({"idempotency_key": idempotency_key}), True)
        if retry_count is not None and retry_count.strip().isdigit():
            return cls(body_digest, int(retry_count) > 0)
        return cls(body_digest, True)


@dataclass(frozen=True)
class InFlight:
    """A call dispatched: what waiting for it and answering it need."""

    session: Session
    turn: int
    pending: Pending
    started: float
    answer: Callable[[list[dict[str, Any]], InFlight], dict[str, Any]]  # its rows (`turn_rows`), itself
    assistant_of: Callable[[dict[str, Any]], dict[str, Any]]
    live: Callable[[str], LiveTurn]  # the SSE events (given the turn id) of a streamed call (`pipeline.serve.live`)
    conversation: Conversation | None  # a chat call's messages (its record joins the index by reply)
    route: Route | None = None  # where this server routed the call (None: another call enqueued it)
    home: str | None = None  # the worker routed to as the holder of its prefix

    @property
    def turn_id(self) -> str:
        return self.pending.turn_id(self.session.session_id, self.turn)


@dataclass(frozen=True)
class Prompt:
    """A call's prompt: ids for the queue, text for the row, the call it extends, whether it broke
    the session's prefix."""

    ids: np.ndarray  # int32
    text: str | None
    parent: Parent | None
    prefix_break: bool


class Turns:
    """Serves turns of any session of one pool (sessions and their turns' queues are in Redis)."""

    def __init__(self, conn: redis.Redis, settings: TurnSettings, renderer: ChatRenderer | None) -> None:
        self.conn = conn
        self.settings = settings
        self.renderer = renderer
        self.counts = TurnCounts(conn)  # the pool's turn counts, written every half second
        self.sessions = SessionStore(conn, self.counts, max_calls=settings.max_session_calls)
        self.conversations = Conversations()
        self.dispatch = TurnDispatch(conn, settings.pool, turn_timeout_s=settings.turn_timeout_s,
                                     affinity=settings.affinity, load_factor=settings.load_factor)

    def close(self) -> None:
        """Write the turn counts held here, stop taking answers."""
        self.counts.close()
        self.dispatch.close()

    # -- sessions -----------------------------------------------------------------------------

    async def _open(self, session_id: str | None, create: bool, identity: CallIdentity, pending: Pending,
                    reply_keys: Sequence[str], longest_end: int) -> Opened:
        """The named session with what the call needs of it, the call claimed (`SessionStore.open`: 404 if
        unknown unless `create`, 409 if ended or another pool's), or a new session of one call."""
        self.sessions.bind_async(self.dispatch.waiter.async_conn())

        async def open_session(sid: str) -> Opened:
            opened = await self.sessions.open_async(sid, same=identity.digest if identity.retry else None,
                                                    claim=pending, pool=self.settings.pool,
                                                    reply_keys=reply_keys[:NEAREST_REPLIES], longest_end=longest_end)
            if opened.parent is None and len(reply_keys) > NEAREST_REPLIES:  # a parent further back (a branch)
                parent = await self.sessions.parent_by_replies_async(sid, reply_keys[NEAREST_REPLIES:])
                opened = dataclasses.replace(opened, parent=parent)
            return opened

        if session_id is None:
            created = await anyio.to_thread.run_sync(functools.partial(
                self.sessions.create, run=self.settings.run, pool=self.settings.pool, output=self.settings.output,
                ephemeral=True))
            return await open_session(created.session_id)
        try:
            return await open_session(session_id)
        except APIError as exc:
            if exc.status != 404 or not create:
                raise
        await anyio.to_thread.run_sync(functools.partial(
            self.sessions.get_or_create, session_id, run=self.settings.run, pool=self.settings.pool,
            output=self.settings.output))
        return await open_session(session_id)

    @contextlib.asynccontextmanager
    async def _ended_if_refused(self, session: Session) -> AsyncIterator[None]:
        """A session of one call (no session named) that the call never turns into a turn (refused: too
        long, invalid) is ended at once, not left open."""
        try:
            yield
        except BaseException:
            if session.ephemeral:
                with contextlib.suppress(Exception):
                    await anyio.to_thread.run_sync(self.sessions.end, session.session_id)
            raise

    def _release_failed(self, call: InFlight) -> None:
        """A failed call: its pending entry goes; a session of one call ends with it."""
        self.sessions.release(call.session.session_id, call.turn, call.pending)
        if call.session.ephemeral:
            self.sessions.end(call.session.session_id)

    def history_of(self, session: Session) -> str:
        return session.history or self.settings.history

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

    def _head(self, answer_id: str, kind: str, model: str) -> dict[str, Any]:
        return {"id": answer_id, "object": kind, "created": int(time.time()), "model": model}

    async def named_adapter(self, model: str | None) -> str | None:
        """The pool's LoRA adapter a call's `model` names (vLLM's convention), or None: the call runs on
        its session's adapter, else the base weights. The served model's name names none, nor does a
        name that is no adapter's (a harness's fixed model name); a name a letter or two from an
        adapter's is refused (404, did you mean), never served by the base weights."""
        if model is None or model == self.settings.model or not ADAPTER_NAME.match(model):
            return None
        router = self.dispatch.router
        await router.fresh()
        known = router.adapter_versions()
        if model not in known:  # pushed since the last read?
            await router.fresh(adapters_within_s=REREAD_S)
            known = router.adapter_versions(fresh=True)
        if model in known:
            return model
        if known and difflib.get_close_matches(model, list(known), n=1, cutoff=TYPO_CUTOFF):
            raise APIError(404, f"the model {model!r} does not exist{did_you_mean(model, known)} (models: "
                                f"{self.settings.model}, adapters: {listing(known)})", param="model",
                           code="model_not_found")
        return None

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

    async def chat(self, body: ChatCompletionBody, session_id: str | None, *, create: bool = False,
                   idempotency_key: str | None = None, retry_count: str | None = None) -> dict[str, Any] | InFlight:
        """Start a chat call of `session_id` (None: a session of one call; `create`: open it if unknown):
        its answer when the call was answered before (a client's retry), else the call in flight
        (`wait`/`wait_async` for its rows, then `finish`). `idempotency_key` and `retry_count`: the
        client's headers that say which call this is (`CallIdentity.of`)."""
        adapter = await self.named_adapter(body.model)  # as vLLM checks a call's model first
        self._tokenizer()
        model = adapter or self.settings.model
        conversation = self.conversations.of(session_id, body.messages)  # the new messages dumped and digested
        # The call's digest (a client's retry is the same call): the conversation's and the rest's.
        body_digest = digest({"messages": conversation.whole(), **body.model_dump(
            mode="json", exclude={"stream", "stream_options", "messages"}, exclude_none=True)})
        identity = CallIdentity.of(body_digest, idempotency_key=idempotency_key, retry_count=retry_count)
        rules = ParseRules(self.settings.reasoning_parser if body.separate_reasoning else None,
                           self.settings.tool_call_parser,
                           [t.model_dump(mode="json", exclude_none=True) for t in body.tools or []] or None,
                           body.tool_choice == "none", body.chat_template_kwargs)
        # SGLang keeps special tokens in the text when tools may be called (tool-call markers often are).
        keep_specials = bool(rules.tools) and not rules.tool_choice_none
        if keep_specials:
            body = body.model_copy(update={"skip_special_tokens": False})
        # The replies a parent may have sent: each assistant message followed by more, the latest first.
        reply_keys = conversation.earlier_replies(canonical_assistant)

        pending = Pending.new(identity.digest, conversation.whole(), len(body.messages))

        def open_call() -> Awaitable[Opened]:
            # A verbatim parent is looked up in the same read; under a `template` server so are the ends
            # its rendered ids are looked up at (a `template` session of a `verbatim` server reads them after).
            template = self.settings.history == "template"
            return self._open(session_id, create, identity, pending, reply_keys,
                              MAX_PROMPT_TOKENS if template else -1)

        def prompt(opened: Opened) -> Awaitable[Prompt]:
            return self._chat_prompt(body, opened)

        def live(turn_id: str) -> LiveTurn:
            return LiveTurn(chat=True, n=body.n, text=self._text_rules(body, skip_special_tokens=not keep_specials),
                            rules=rules, include_usage=body.include_usage,
                            head=self._head(f"chatcmpl-{turn_id}", "chat.completion.chunk", model))

        def answer(rows: list[dict[str, Any]], call: InFlight) -> dict[str, Any]:
            return chat_answer(rows, turn_id=call.turn_id, model=model,
                               session_id=call.session.session_id, turn=call.turn, rules=rules,
                               token_text=self.token_text, logprobs=body.logprobs,
                               text_of=functools.partial(self._text_of, skip_special_tokens=not keep_specials))

        return await self._call(body, open_call, prompt, pending, answer, conversation, adapter,
                                assistant_of=lambda choice: choice["message"], live=live)

    def _chat_request(self, body: ChatCompletionBody) -> ChatRequest:
        """The body as the renderer's request, made of the body's own validated models (messages, tools,
        tool choice, template kwargs) without validating them again: pydantic would take the models as
        they are but run each message's Python validator once more, O(the conversation) a call. The one
        rule of a `ChatRequest` (messages or a prompt, not both) holds: a body has messages."""
        return ChatRequest.model_construct(id="turn", messages=body.messages, tools=body.tools,
                                           tool_choice=body.tool_choice,
                                           chat_template_kwargs=body.chat_template_kwargs)

    async def _chat_prompt(self, body: ChatCompletionBody, opened: Opened) -> Prompt:
        assert self.renderer is not None
        request = self._chat_request(body)
        session, parent = opened.session, opened.parent
        try:
            if self.history_of(session) == "verbatim" and parent is not None:
                extension = self.renderer.render_after_reply(request, parent.record.n_messages,
                                                             parent.choice.completion_text)
                return Prompt(np.concatenate([parent.ids, np.asarray(extension.input_ids, dtype="<i4")]),
                              (parent.record.prompt_text or "") + parent.choice.completion_text
                              + extension.prompt_text, parent, False)
            rendered = self.renderer.render(request)
        except RenderError as exc:
            raise APIError(400, exc.message, param=exc.field, code="render_error") from None
        ids = np.asarray(rendered.input_ids, dtype="<i4")
        if self.history_of(session) == "template":
            parent = await self.sessions.parent_by_tokens_async(session.session_id, ids, opened.ends)
            if parent is not None:
                return Prompt(ids, rendered.prompt_text, parent, False)
        return Prompt(ids, rendered.prompt_text, None, session.turns > 0)

    # -- text / token ids ---------------------------------------------------------------------

    async def completion(self, body: CompletionBody, session_id: str | None, *, create: bool = False,
                         idempotency_key: str | None = None,
                         retry_count: str | None = None) -> dict[str, Any] | InFlight:
        """Start a token-level call (`/v1/completions`); see `chat`."""
        adapter = await self.named_adapter(body.model)
        model = adapter or self.settings.model
        if isinstance(body.prompt, str):
            ids = np.asarray(self._tokenizer()(body.prompt)["input_ids"], dtype="<i4")
            text: str | None = body.prompt
        else:
            ids, text = np.asarray(body.prompt, dtype="<i4"), None
        identity = CallIdentity.of(digest(body.model_dump(mode="json", exclude={"stream", "stream_options"},
                                                          exclude_none=True)),
                                   idempotency_key=idempotency_key, retry_count=retry_count)

        pending = Pending.new(identity.digest, "", 0)

        def open_call() -> Awaitable[Opened]:
            return self._open(session_id, create, identity, pending, (), len(ids) - 1)

        async def prompt(opened: Opened) -> Prompt:
            parent = await self.sessions.parent_by_tokens_async(opened.session.session_id, ids, opened.ends)
            return Prompt(ids, text, parent, parent is None and opened.session.turns > 0)

        def answer(rows: list[dict[str, Any]], call: InFlight) -> dict[str, Any]:
            return text_answer(rows, turn_id=call.turn_id, model=model,
                               session_id=call.session.session_id, turn=call.turn, text_of=self._text_of,
                               token_text=self.token_text, logprobs=body.logprobs)

        def live(turn_id: str) -> LiveTurn:
            skip = body.skip_special_tokens is not False
            return LiveTurn(chat=False, n=body.n, text=self._text_rules(body, skip), include_usage=body.include_usage,
                            head=self._head(f"cmpl-{turn_id}", "text_completion", model))

        return await self._call(body, open_call, prompt, pending, answer, None, adapter,
                          assistant_of=lambda choice: {"role": "assistant", "content": choice["text"]}, live=live)

    # -- the call -----------------------------------------------------------------------------

    async def _call(self, body: ChatCompletionBody | CompletionBody, open_call: Callable[[], Awaitable[Opened]],
                    prompt_of: Callable[[Opened], Awaitable[Prompt]], pending: Pending,
                    answer: Callable[[list[dict[str, Any]], InFlight], dict[str, Any]],
                    conversation: Conversation | None, adapter: str | None, *,
                    assistant_of: Callable[[dict[str, Any]], dict[str, Any]],
                    live: Callable[[str], LiveTurn]) -> dict[str, Any] | InFlight:
        started = time.monotonic()
        opened = await open_call()
        session = opened.session
        async with self._ended_if_refused(session):
            if opened.turn is None:  # a retry: the call it repeats, answered or in flight
                turn, record, original = opened.same  # type: ignore[misc]
                if record is not None:
                    return record.response
                return InFlight(session, turn, original, started, answer, assistant_of, live, conversation)
            try:
                return await self._start(session, opened.turn, pending, body, await prompt_of(opened), conversation,
                                         started, adapter or session.adapter, answer, assistant_of, live)
            except BaseException:
                await anyio.to_thread.run_sync(self.sessions.release, session.session_id, opened.turn, pending)
                raise

    async def _start(self, session: Session, turn: int, pending: Pending, body: ChatCompletionBody | CompletionBody,
               prompt: Prompt, conversation: Conversation | None, started: float, adapter: str | None,
               answer: Callable[[list[dict[str, Any]], InFlight], dict[str, Any]],
               assistant_of: Callable[[dict[str, Any]], dict[str, Any]],
               live: Callable[[str], LiveTurn]) -> InFlight:
        sampling = body.sampling(self._budget(prompt, body.budget()))
        parent = None if prompt.parent is None else (prompt.parent.turn, prompt.parent.sample)
        turn_id = pending.turn_id(session.session_id, turn)
        request = ParsedRequest.of_array({
            "id": f"{session.session_id}:{turn}",
            "sampling_params": sampling.model_dump(exclude_defaults=True), "logprobs": body.logprobs_k,
            "metadata": session.metadata, **({"prompt_text": prompt.text} if prompt.text is not None else {}),
            "routing_key": session.session_id,  # the worker's server holding the session's prefix
            "adapter": adapter,
        }, prompt.ids)
        # Affinity follows the tree: the worker that served the parent holds its ids in its prefix cache.
        home = prompt.parent.record.served_by if prompt.parent is not None else session.home
        route = await self.dispatch.enqueue(request, run=session.run, output=session.output, home=home,
                                            turn=TurnTag(turn_id=turn_id, session_id=session.session_id, turn=turn,
                                               prefix_break=prompt.prefix_break,
                                               parent_turn=None if parent is None else parent[0],
                                               parent_sample=None if parent is None else parent[1],
                                               stream=body.stream, reply_to=self.dispatch.inbox.server_id))
        return InFlight(session, turn, pending, started, answer, assistant_of, live, conversation, route, home)

    async def wait_async(self, call: InFlight) -> pa.Table | dict[str, Any]:
        """The call's rows (or its answer, recorded meanwhile by another waiter), on the event loop:
        blocks no thread while the call is generated."""
        async with self._failed_turn_released(call):
            return await self.dispatch.wait_async(call.turn_id, call.session.run, call.started, self._settled(call))

    async def stream_async(self, call: InFlight) -> AsyncIterator[list[TokenDelta] | Answered]:
        """`wait_async` for a streamed call: batches of the call's tokens as they come, then the rows."""
        async with self._failed_turn_released(call):
            async for item in self.dispatch.stream_async(call.turn_id, call.session.run, call.started,
                                                     self._settled(call)):
                yield item

    @contextlib.asynccontextmanager
    async def _failed_turn_released(self, call: InFlight) -> AsyncIterator[None]:
        """A call that failed on its worker releases its pending entry (`_release_failed`)."""
        try:
            yield
        except APIError as exc:
            if exc.code == "turn_failed":
                await anyio.to_thread.run_sync(self._release_failed, call)
            raise

    async def finish(self, call: InFlight, got: pa.Table | dict[str, Any]) -> dict[str, Any]:
        """The answer of a call from its rows, recorded in its session."""
        if isinstance(got, dict):
            return got
        rows = turn_rows(got)
        response = call.answer(rows, call)
        await self._record(call, rows, response)
        return response

    def _settled(self, call: InFlight) -> Callable[[], dict[str, Any] | None]:
        """The answer of this call if another waiter recorded it meanwhile."""
        return functools.partial(self.sessions.answer_of, call.session.session_id, call.turn)

    async def _record(self, call: InFlight, rows: list[dict[str, Any]], response: dict[str, Any]) -> None:
        session, pending, assistant_of = call.session, call.pending, call.assistant_of
        # Where the call sits in the tree, as its rows carry it (`TurnTag`): any server can record it.
        parent = None if rows[0]["parent_turn"] is None else (rows[0]["parent_turn"], rows[0]["parent_sample"])
        choices = [Choice(row["completion_token_ids"], self._special_text(row["completion_token_ids"]),
                          canonical_assistant(assistant_of(choice)))
                   for row, choice in zip(rows, response["choices"], strict=True)]
        record = TurnRecord(call.turn, call.turn_id, pending.request_digest, pending.conversation, pending.n_messages,
                            rows[0]["prompt_token_ids"], rows[0]["prompt_text"], choices, response, parent,
                            rows[0]["worker_id"])
        versions = [v for row in rows for v in ([row["weight_version"]] + [s["version"] for s in
                                                                            row["weight_version_segments"] or []])]
        placed = Placed(served_by=rows[0]["worker_id"], routed_to=None if call.route is None else call.route.worker,
                        moved=None if call.route is None else call.route.moved,
                        prompt_tokens=sum(r["prompt_tokens"] for r in rows),
                        cached_tokens=sum(r["cached_tokens"] for r in rows))
        await self.sessions.record_async(session, record, (min(versions), max(versions)), placed, call.conversation,
                                         call.home, prefix_break=rows[0]["prefix_break"])
        if session.ephemeral:
            await anyio.to_thread.run_sync(self.sessions.end, session.session_id)
