"""Agent sessions in Redis: a session is a tree of calls, and a server holds none of it in memory.

A session (`keys.session`) is a hash: its run, pool and output, metadata, the LoRA adapter every
call of it runs on (if any), its history mode (`HISTORY_MODES`), state (`open` or `ended`), the
number of calls started (`calls`, which numbers them) and committed (`turns`), those in flight, the
reward, the weight versions its calls used, and its home (the worker that served its last call).

Its calls live in a second hash (`keys.session_calls`), so any number of them can be in flight at
once and a server places each new call in O(its own messages), whatever the session's size:

- `r:<turn>`: a committed call (`TurnRecord`): its prompt ids, each choice's completion ids and
  assistant message, its parent, the worker that served it, and the answer sent (a client's retry is
  answered again from it, not generated again);
- `p:<turn>`: a call in flight (`Pending`), so any server can wait for it or record it;
- `d:<request digest>`: the latest call with that body (where a retry finds its call);
- `m:<reply key>` and `t:<token key>`: the index that places a new call under the call it extends.
  A chat call's reply key digests its conversation up to and including one choice's assistant message
  (`Conversation.reply_key`); a token key digests one choice's prompt + completion ids
  (`token_key`), looked up at the lengths in `keys.session_ends`. Two choices with the same key (two
  identical calls, or two identical samples) index the lowest turn, then the lowest sample.

Everything that changes a session happens in one Lua script each (`_OPEN`, which reads what a call
needs and claims it, `_RECORD`, `_RELEASE`), so concurrent calls and servers never see half of a change.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import orjson
import redis

from pipeline.core import adapters
from pipeline.core.broker import keys
from pipeline.core.errors import AdapterError
from pipeline.serve.api_error import APIError
from pipeline.serve.conversation import Conversation
from pipeline.serve.turn_counts import TurnCounts
from schemas.turn_id import TurnId

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SESSION_TTL_S = 7 * 24 * 3600  # an idle session's state expires 6-7 days after its last turn:
TTL_REFRESH_S = 24 * 3600  # its expiry is pushed back by a turn once it was set this long ago
MAX_CALLS = 4096  # calls one session may start (`pipeline serve --max-session-calls`)
# How a chat call's prompt is made from its history (`pipeline serve --history`, a session's `history`):
# `verbatim` extends the sampled ids of the call it continues (the model sees what it sampled, its
# reasoning included); `template` renders every call as the chat template renders it (e.g. earlier
# reasoning stripped), a child of an earlier call only where its ids extend that call's exactly.
HISTORY_MODES = ("verbatim", "template")

# KEYS: the session, its calls, its ends. ARGV: the `d:` field of the call's body to look for ('' for
# none: not a retry), the longest prefix (tokens) to list ends up to (-1: none), the call's pending entry
# ('' to claim none), its `d:` field, the most calls a session may start, the pool the server serves,
# then `m:` fields, longest first. Reads the session's hash (empty if unknown: nothing more), for the
# body's latest call its turn, record and pending entry, the first `m:` hit's value and its call's
# record, and the ends; then claims the call: its number, or false (a call of that body stands for it:
# a retry), -1 (the session is not open), -3 (it has started its most calls), -4 (another pool's).
# One script: the call is numbered and the parent it is placed under read in the same step.
_OPEN = """
local session = redis.call('HGETALL', KEYS[1])
if #session == 0 then return {session} end
local field = {}
for i = 1, #session, 2 do field[session[i]] = session[i + 1] end
local same, same_record, same_pending = false, false, false
if ARGV[1] ~= '' then
  same = redis.call('HGET', KEYS[2], ARGV[1])
  if same then
    local held = redis.call('HMGET', KEYS[2], 'r:' .. same, 'p:' .. same)
    same_record, same_pending = held[1], held[2]
  end
end
local parent, parent_record = false, false
if #ARGV >= 7 then
  local hits = redis.call('HMGET', KEYS[2], unpack(ARGV, 7))
  for i = 1, #hits do
    if hits[i] then
      parent = hits[i]
      parent_record = redis.call('HGET', KEYS[2], 'r:' .. string.match(parent, '^(%d+):'))
      break
    end
  end
end
local ends = {}
if tonumber(ARGV[2]) >= 0 then ends = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[2]) end
local claimed = false
if ARGV[3] ~= '' and not (same_record or same_pending) then
  if field['state'] ~= 'open' then
    claimed = -1
  elseif field['pool'] ~= ARGV[6] then
    claimed = -4
  elseif tonumber(field['calls'] or '0') >= tonumber(ARGV[5]) then
    claimed = -3
  else
    claimed = redis.call('HINCRBY', KEYS[1], 'calls', 1) - 1
    redis.call('HINCRBY', KEYS[1], 'in_flight', 1)
    redis.call('HSET', KEYS[2], 'p:' .. claimed, ARGV[3], ARGV[4], claimed)
    if claimed == 0 then  -- later calls find the calls' expiry set, and each record moves it with the session's
      local ttl = redis.call('TTL', KEYS[1])
      if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
    end
  end
end
return {session, same, same_record, same_pending, parent, parent_record, ends, claimed}
"""

# KEYS: the session's calls. ARGV: `t:` (or `m:`) fields, longest first. The first hit's value and its call's record.
_FIRST = """
for i = 1, #ARGV do
  local hit = redis.call('HGET', KEYS[1], ARGV[i])
  if hit then return {hit, redis.call('HGET', KEYS[1], 'r:' .. string.match(hit, '^(%d+):'))} end
end
return {false, false}
"""

# KEYS: the session, its calls, its ends, the run's turn counts. ARGV: the turn, its record, the worker
# that served it, the lowest and highest weight version it used, the session's TTL, 1 if the call broke
# the session's prefix, the time (ms) to note the TTL as set at (0: leave it), then triples of an index
# field, its value (`turn:sample`) and the length to add to the ends ('' for none). The record replaces
# the pending entry (a second record of the same call changes nothing), the counts move, index entries
# are kept for the lowest turn: one script, atomic.
_RECORD = """
local turn = ARGV[1]
if redis.call('HEXISTS', KEYS[2], 'r:' .. turn) == 1 then return 0 end
redis.call('HSET', KEYS[2], 'r:' .. turn, ARGV[2])
if redis.call('HDEL', KEYS[2], 'p:' .. turn) == 1 then redis.call('HINCRBY', KEYS[1], 'in_flight', -1) end
redis.call('HINCRBY', KEYS[1], 'turns', 1)
local function put(list, a, b) list[#list + 1] = a; list[#list + 1] = b end
local session = {'home', ARGV[3]}
local range = redis.call('HMGET', KEYS[1], 'min_version', 'max_version')
if not range[1] or tonumber(ARGV[4]) < tonumber(range[1]) then put(session, 'min_version', ARGV[4]) end
if not range[2] or tonumber(ARGV[5]) > tonumber(range[2]) then put(session, 'max_version', ARGV[5]) end
if ARGV[8] ~= '0' then put(session, 'ttl_set_ms', ARGV[8]) end
redis.call('HSET', KEYS[1], unpack(session))
if #ARGV >= 9 then
  local fields = {}
  for i = 9, #ARGV, 3 do table.insert(fields, ARGV[i]) end
  local held = redis.call('HMGET', KEYS[2], unpack(fields))
  local index, ends = {}, {}
  for i = 9, #ARGV, 3 do
    local was = held[(i - 6) / 3]
    if not was or tonumber(string.match(was, '^(%d+):')) > tonumber(turn) then put(index, ARGV[i], ARGV[i + 1]) end
    if ARGV[i + 2] ~= '' then put(ends, ARGV[i + 2], ARGV[i + 2]) end
  end
  if #index > 0 then redis.call('HSET', KEYS[2], unpack(index)) end
  if #ends > 0 then redis.call('ZADD', KEYS[3], unpack(ends)) end
end
local ttl = ARGV[6]
if ARGV[8] ~= '0' then
  redis.call('EXPIRE', KEYS[1], ttl)
else
  ttl = redis.call('TTL', KEYS[1])
end
if tonumber(ttl) > 0 then
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('EXPIRE', KEYS[3], ttl)
end
if ARGV[7] == '1' then
  redis.call('HINCRBY', KEYS[4], 'prefix_breaks', 1)
  redis.call('HINCRBY', KEYS[1], 'prefix_breaks', 1)
end
return 1
"""

# KEYS: the session, its calls. ARGV: the turn, its pending entry. A call that will not be recorded
# (its job failed or could not be enqueued) leaves the session's calls in flight.
_RELEASE = """
if redis.call('HGET', KEYS[2], 'p:' .. ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[2], 'p:' .. ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'in_flight', -1)
end
"""


def ended(session_id: str) -> APIError:
    """The refusal of a turn of a session that has ended."""
    return APIError(409, f"session {session_id!r} has ended; open a new one with POST /sessions",
                    param="session_id", code="session_ended")


def new_session_id(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}"


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.match(session_id):
        raise APIError(400, f"session id {session_id!r} must be 1-64 letters, digits, '.', '_' or '-', starting "
                            "with a letter or digit", param="session_id")
    return session_id


def check_history(history: Any) -> str:
    if history not in HISTORY_MODES:
        raise APIError(400, f"history is one of {', '.join(HISTORY_MODES)}, not {history!r}", param="history")
    return history


def pack_ids(ids: Any) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode("ascii")


def unpack_ids(packed: str) -> np.ndarray:
    """The ids `pack_ids` packed, as a (read-only) int32 array: no Python int per id."""
    return np.frombuffer(base64.b64decode(packed), dtype="<i4")


def _joined(prompt_ids: np.ndarray, completion_ids: Sequence[int]) -> np.ndarray:
    return np.concatenate([prompt_ids, np.asarray(completion_ids, dtype="<i4")])


def token_key(ids: Sequence[int]) -> str:
    """The index field of a choice whose prompt + completion ids are `ids`."""
    return "t:" + hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:32]


def token_keys(ids: Sequence[int], lengths: Iterable[int]) -> list[str]:
    """`token_key(ids[:n])` for each n of `lengths`, longest first, hashing `ids` once."""
    data = np.asarray(ids, dtype="<i4").tobytes()
    state, at, out = hashlib.sha256(), 0, []
    for n in sorted(set(lengths)):
        state.update(data[at * 4:n * 4])
        at = n
        out.append("t:" + state.copy().hexdigest()[:32])
    return out[::-1]


@dataclass
class Choice:
    """One sample of a committed call, as a later call needs it."""

    completion_ids: list[int]
    completion_text: str  # decoded with special tokens: what the template's glue is matched against
    assistant: dict[str, Any]  # the canonical assistant message sent (`canonical_assistant`)

    def to_json(self) -> dict[str, Any]:
        return {"ids": pack_ids(self.completion_ids), "text": self.completion_text, "assistant": self.assistant}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Choice:
        return cls(unpack_ids(data["ids"]).tolist(), data["text"], data["assistant"])


@dataclass
class TurnRecord:
    """A committed call of a session."""

    turn: int
    turn_id: str
    request_digest: str
    conversation: str  # `Conversation.whole()` of its messages ('' for a token-level call)
    n_messages: int
    prompt_ids: np.ndarray  # int32: a long prompt's ids are never a Python list on the server
    prompt_text: str | None
    choices: list[Choice]
    response: dict[str, Any]
    parent: tuple[int, int] | None = None  # the call and sample this one extends
    served_by: str | None = None  # the worker that served it: its prefix cache holds the call's ids

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype="<i4")

    def to_json(self) -> bytes:
        # orjson: a long conversation's prompt (its ids packed, its text) is most of a record.
        return orjson.dumps({
            "turn": self.turn, "turn_id": self.turn_id, "request_digest": self.request_digest,
            "conversation": self.conversation, "n_messages": self.n_messages,
            "prompt_ids": pack_ids(self.prompt_ids), "prompt_text": self.prompt_text,
            "choices": [c.to_json() for c in self.choices], "response": self.response,
            "parent": None if self.parent is None else list(self.parent), "served_by": self.served_by,
        })

    @classmethod
    def from_json(cls, raw: bytes | str) -> TurnRecord:
        data = orjson.loads(raw)
        return cls(data["turn"], data["turn_id"], data["request_digest"], data["conversation"], data["n_messages"],
                   unpack_ids(data["prompt_ids"]), data["prompt_text"],
                   [Choice.from_json(c) for c in data["choices"]], data["response"],
                   None if data["parent"] is None else (data["parent"][0], data["parent"][1]), data["served_by"])

    def index(self, conversation: Conversation | None) -> list[str]:
        """The index fields, values and ends of its choices (`_RECORD`'s triples): a chat call's by
        reply (`conversation` of its messages) and every call's by tokens."""
        triples: list[str] = []
        for sample, choice in enumerate(self.choices):
            where = f"{self.turn}:{sample}"
            if conversation is not None:
                triples += [conversation.reply_key(self.n_messages, choice.assistant), where, ""]
            ids = _joined(self.prompt_ids, choice.completion_ids)
            triples += [token_key(ids), where, str(len(ids))]
        return triples


@dataclass(frozen=True)
class Pending:
    """A call in flight: enough for any server to wait for it and record it."""

    nonce: str
    request_digest: str
    conversation: str
    n_messages: int

    @classmethod
    def new(cls, request_digest: str, conversation: str, n_messages: int) -> Pending:
        return cls(uuid.uuid4().hex[:6], request_digest, conversation, n_messages)

    def turn_id(self, session_id: str, turn: int) -> str:
        return str(TurnId(session_id, turn, self.nonce))

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Pending:
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Placed:
    """Where a committed turn ran: the worker that served it, the worker it was routed to and why
    that was not the session's home (`affinity.Route`; None when this server did not route it), and
    its prompt tokens, of which `cached_tokens` the engine found in its prefix cache."""

    served_by: str
    routed_to: str | None
    moved: str | None
    prompt_tokens: int
    cached_tokens: int

    def increments(self, home: str | None) -> dict[str, int]:
        """The turn's part in the pool's affinity counts (`keys.PoolKeys.turn_stats`): turns; turns of a
        session with a home, and those served there; prompt and cached tokens; moves by reason (a turn
        routed home that ran elsewhere moved because its worker died: `gone`)."""
        counts = {"turns": 1, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}
        if home is None:
            return counts
        counts["homed_turns"] = 1
        if self.served_by == home:
            counts["home_turns"] = 1
        else:
            counts[f"moves:{self.moved if self.moved and self.served_by == self.routed_to else 'gone'}"] = 1
        return counts


@dataclass
class Session:
    """A session as read from Redis."""

    session_id: str
    run: str
    pool: str
    output: str
    state: str
    turns: int  # calls committed
    metadata: dict[str, Any] = field(default_factory=dict)
    calls: int = 0  # calls started (the next call's number)
    in_flight: int = 0
    reward: dict[str, Any] | None = None
    min_version: int | None = None
    max_version: int | None = None
    ephemeral: bool = False
    home: str | None = None  # the worker that served its last call (`pipeline.core.affinity`)
    ttl_set_ms: int = 0  # when its expiry was last set (`TTL_REFRESH_S`)
    adapter: str | None = None  # the LoRA adapter every call runs on (None: the base weights)
    history: str | None = None  # its history mode (None: the server's)

    def public(self) -> dict[str, Any]:
        """The session as `GET /sessions/<id>` shows it."""
        return {"session_id": self.session_id, "run": self.run, "pool": self.pool, "state": self.state,
                "turns": self.turns, "calls_in_flight": self.in_flight, "metadata": self.metadata,
                "adapter": self.adapter, "history": self.history, "reward": self.reward,
                "weight_versions": None if self.min_version is None else [self.min_version, self.max_version]}

    @classmethod
    def from_hash(cls, session_id: str, raw: dict[bytes, bytes] | list[bytes]) -> Session:
        if isinstance(raw, list):  # HGETALL's reply inside a script: field, value, ...
            raw = dict(zip(raw[::2], raw[1::2], strict=True))
        data = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(
            session_id, data["run"], data["pool"], data["output"], data["state"], int(data.get("turns") or 0),
            json.loads(data.get("metadata") or "{}"), int(data.get("calls") or 0), int(data.get("in_flight") or 0),
            json.loads(data["reward"]) if "reward" in data else None,
            int(data["min_version"]) if "min_version" in data else None,
            int(data["max_version"]) if "max_version" in data else None,
            data.get("ephemeral") == "1", data.get("home"), int(data.get("ttl_set_ms") or 0),
            data.get("adapter"), data.get("history"),
        )


@dataclass(frozen=True)
class Parent:
    """The committed call (and its sample) a new call extends."""

    turn: int
    sample: int
    record: TurnRecord

    @property
    def choice(self) -> Choice:
        return self.record.choices[self.sample]

    @functools.cached_property
    def ids(self) -> np.ndarray:
        """The prompt and completion ids of the choice (int32)."""
        return _joined(self.record.prompt_ids, self.choice.completion_ids)


@dataclass(frozen=True)
class Opened:
    """What a server reads to start a call (`SessionStore.open`): the session; the latest call with
    the same body, committed or in flight (None when none, or none was looked for); the call it
    extends by its messages (a chat call's reply keys); the lengths a call's ids are looked up at
    (`SessionStore.parent_by_tokens`; None: not listed)."""

    session: Session
    same: tuple[int, TurnRecord | None, Pending | None] | None
    parent: Parent | None
    ends: list[int] | None
    turn: int | None  # the number of the call claimed; None when a call of the same body stands for it


def _parent(hit: bytes | None, record: bytes | None) -> Parent | None:
    if hit is None or record is None:
        return None
    turn, sample = hit.decode().split(":")
    return Parent(int(turn), int(sample), TurnRecord.from_json(record))


def _not_found(session_id: str) -> APIError:
    days = f"{(SESSION_TTL_S - TTL_REFRESH_S) // 86400}-{SESSION_TTL_S // 86400}"
    return APIError(404, f"no session {session_id!r}: create it with POST /sessions (it may have expired "
                         f"{days} days after its last turn)", param="session_id", code="session_not_found")


class SessionStore:
    """Sessions of one Redis. A call's three scripts (`open`, `parent_by_tokens`, `record`) have `_async`
    twins that a server awaits on its event loop through an asyncio client (`bind_async`; without one,
    a Redis reached through Sentinel or TLS, they run the sync client in a thread); the rest is sync."""

    def __init__(self, conn: redis.Redis, counts: TurnCounts | None = None, *, max_calls: int = MAX_CALLS) -> None:
        self.conn = conn
        # The pool's turn counts: written in batches by a server, with each turn by default.
        self.counts = counts or TurnCounts(conn, every_s=0)
        self.max_calls = max_calls
        self._open = conn.register_script(_OPEN)
        self._first = conn.register_script(_FIRST)
        self._record = conn.register_script(_RECORD)
        self._release = conn.register_script(_RELEASE)
        self._async: dict[str, Any] | None = None  # the call's scripts on an asyncio client (`bind_async`)

    def bind_async(self, aconn: Any) -> None:
        """Run the call's scripts on `aconn` (a `redis.asyncio.Redis` to the same Redis) in the `_async`
        methods, once; None leaves them in threads."""
        if self._async is None and aconn is not None:
            self._async = {"open": aconn.register_script(_OPEN), "first": aconn.register_script(_FIRST),
                           "record": aconn.register_script(_RECORD)}

    def create(self, *, run: str, pool: str, output: str, metadata: dict[str, Any] | None = None,
               session_id: str | None = None, ephemeral: bool = False, adapter: str | None = None,
               history: str | None = None) -> Session:
        """A new open session (409 if `session_id` is taken; 400 if the pool has no adapter `adapter`)."""
        session_id = check_session_id(session_id) if session_id else new_session_id("call" if ephemeral else "s")
        where = keys.pool(pool)
        if history is not None:
            check_history(history)
        if adapter is not None:
            if not isinstance(adapter, str):
                raise APIError(400, "adapter is the name of a LoRA adapter of the pool", param="adapter")
            try:
                adapters.check_known(self.conn, where.name, adapter)
            except AdapterError as exc:
                raise APIError(400, str(exc), param="adapter", code="adapter_not_found") from None
        key = keys.session(session_id)
        now_ms = int(time.time() * 1000)
        fields = {"run": run, "pool": where.name, "output": output, "state": "open", "turns": 0,
                  "metadata": json.dumps(metadata or {}), "created_ms": now_ms, "ttl_set_ms": now_ms,
                  "ephemeral": int(ephemeral), **({"adapter": adapter} if adapter is not None else {}),
                  **({"history": history} if history is not None else {})}
        if not self.conn.hsetnx(key, "run", run):
            raise APIError(409, f"session {session_id!r} exists already; create it once, or use another id",
                           param="session_id")
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, SESSION_TTL_S)
            pipe.sadd(where.open_sessions, session_id)
            pipe.sadd(where.runs, run)
            pipe.sadd(keys.POOLS, where.name)
            pipe.setnx(keys.turn_log_output(run), output)
            pipe.execute()
        return Session(session_id, run, where.name, output, "open", 0, metadata or {}, ephemeral=ephemeral,
                       ttl_set_ms=now_ms, adapter=adapter, history=history)

    def get_or_create(self, session_id: str, *, run: str, pool: str, output: str) -> Session:
        """The session, created (open, no metadata) if unknown."""
        try:
            return self.get(session_id)
        except APIError as exc:
            if exc.status != 404:
                raise
        try:
            return self.create(run=run, pool=pool, output=output, session_id=session_id)
        except APIError as exc:
            if exc.status != 409:  # created by another call meanwhile
                raise
            return self.get(session_id)

    def get(self, session_id: str) -> Session:
        """The session, or 404."""
        raw = self.conn.hgetall(keys.session(check_session_id(session_id)))
        if not raw or b"pool" not in raw:
            raise _not_found(session_id)
        return Session.from_hash(session_id, raw)

    def open(self, session_id: str, *, same: str | None, claim: Pending, pool: str, reply_keys: Sequence[str] = (),
             longest_end: int = -1) -> Opened:
        """One round trip to start a call (404 for an unknown session): the session, the latest call of the
        body digested `same` (None: look for none; a retry), the longest-listed of `reply_keys` that a
        committed call holds, and the ends up to `longest_end` tokens (-1: none); and the call claimed as
        `claim` (`Opened.turn`), unless a call of `same` stands for it. 409 if the session has ended (its
        episode canceled: `pipeline.core.jobs.episodes.cancel_run`) or belongs to another pool than
        `pool`; 413 past its limit of calls."""
        where, args = self._open_call(session_id, same, claim, pool, reply_keys, longest_end)
        return self._opened(session_id, self._open(keys=where, args=args), pool, longest_end)

    async def open_async(self, session_id: str, *, same: str | None, claim: Pending, pool: str,
                         reply_keys: Sequence[str] = (), longest_end: int = -1) -> Opened:
        """`open`, awaited."""
        if self._async is None:
            return await anyio.to_thread.run_sync(functools.partial(
                self.open, session_id, same=same, claim=claim, pool=pool, reply_keys=reply_keys,
                longest_end=longest_end))
        where, args = self._open_call(session_id, same, claim, pool, reply_keys, longest_end)
        return self._opened(session_id, await self._async["open"](keys=where, args=args), pool, longest_end)

    def _open_call(self, session_id: str, same: str | None, claim: Pending, pool: str, reply_keys: Sequence[str],
                   longest_end: int) -> tuple[list[str], list[Any]]:
        where = [keys.session(session_id), keys.session_calls(session_id), keys.session_ends(session_id)]
        return where, ["" if same is None else f"d:{same}", longest_end, claim.to_json(), f"d:{claim.request_digest}",
                       self.max_calls, pool, *reply_keys]

    def _opened(self, session_id: str, reply: list[Any], pool: str, longest_end: int) -> Opened:
        if not reply[0]:
            raise _not_found(session_id)
        session_hash, same_turn, same_record, same_pending, hit, hit_record, ends, claimed = reply
        session = Session.from_hash(session_id, session_hash)
        if claimed == -1:
            raise ended(session_id)
        if claimed == -4:
            raise APIError(409, f"session {session_id!r} belongs to pool {session.pool!r}; this server serves pool "
                                f"{pool!r}", param="session_id", code="wrong_pool")
        if claimed == -3:
            raise APIError(413, f"session {session_id!r} has started {self.max_calls} calls, the most one "
                                "session may (`pipeline serve --max-session-calls`); its calls so far are all kept: "
                                "end it and open a new session", param="session_id", code="session_too_large")
        found = None if same_turn is None else (
            int(same_turn), None if same_record is None else TurnRecord.from_json(same_record),
            None if same_pending is None else Pending.from_json(same_pending))
        return Opened(session, found, _parent(hit, hit_record), None if longest_end < 0 else [int(n) for n in ends],
                      None if claimed is None else int(claimed))

    def parent_by_tokens(self, session_id: str, ids: Sequence[int], ends: Sequence[int] | None) -> Parent | None:
        """The committed choice with the longest prompt + completion that `ids` extends (`ends`: the
        lengths `open` listed; None: read them here)."""
        if ends is None:
            ends = [int(n) for n in self.conn.zrangebyscore(keys.session_ends(session_id), "-inf", len(ids) - 1)]
        lengths = [n for n in ends if 0 < n < len(ids)]
        if not lengths:
            return None
        return self._extended(ids, *self._first(keys=[keys.session_calls(session_id)], args=token_keys(ids, lengths)))

    async def parent_by_tokens_async(self, session_id: str, ids: Sequence[int],
                                     ends: Sequence[int] | None) -> Parent | None:
        """`parent_by_tokens`, awaited."""
        if self._async is None or ends is None:
            return await anyio.to_thread.run_sync(self.parent_by_tokens, session_id, ids, ends)
        lengths = [n for n in ends if 0 < n < len(ids)]
        if not lengths:
            return None
        found = await self._async["first"](keys=[keys.session_calls(session_id)], args=token_keys(ids, lengths))
        return self._extended(ids, *found)

    @staticmethod
    def _extended(ids: Sequence[int], hit: bytes | None, record: bytes | None) -> Parent | None:
        parent = _parent(hit, record)
        # A digest is no proof: the ids themselves must match (a collision must not graft a call).
        if parent is not None and not np.array_equal(np.asarray(ids[: len(parent.ids)]), parent.ids):
            return None
        return parent

    async def parent_by_replies_async(self, session_id: str, reply_keys: Sequence[str]) -> Parent | None:
        """The committed call that the first of `reply_keys` (a chat call's, latest first) found names: a
        parent further back than the ones `open` looked for."""
        if self._async is None:
            return await anyio.to_thread.run_sync(lambda: _parent(*self._first(
                keys=[keys.session_calls(session_id)], args=list(reply_keys))))
        return _parent(*await self._async["first"](keys=[keys.session_calls(session_id)], args=list(reply_keys)))

    def release(self, session_id: str, turn: int, pending: Pending) -> None:
        """Drop a call in flight that will not be recorded (its job failed or could not be enqueued)."""
        self._release(keys=[keys.session(session_id), keys.session_calls(session_id)], args=[turn, pending.to_json()])

    def answer_of(self, session_id: str, turn: int) -> dict[str, Any] | None:
        """The answer recorded for a call, if it is committed."""
        raw = self.conn.hget(keys.session_calls(session_id), f"r:{turn}")
        return None if raw is None else TurnRecord.from_json(raw).response

    def pending_of(self, session_id: str, turn: int) -> Pending | None:
        raw = self.conn.hget(keys.session_calls(session_id), f"p:{turn}")
        return None if raw is None else Pending.from_json(raw)

    def record(self, session: Session, record: TurnRecord, versions: tuple[int, int], placed: Placed,
               conversation: Conversation | None, home: str | None, *, prefix_break: bool) -> None:
        """Commit a call: its record replaces its pending entry, it joins the index (so later calls can
        extend it), counts move, the session's weight versions widen, and the worker that served it
        becomes the session's home (the pool's affinity counts move with it, at once or in `counts`'
        next batch). `session` is the session as read when the call began (its expiry is taken from it);
        `home` the worker the call was routed to as the holder of its prefix (its parent's, else the session's);
        `prefix_break`: the call is a root started after the session's first call (counted)."""
        where, args = self._record_call(session, record, versions, placed, conversation, prefix_break)
        if self._record(keys=where, args=args):
            self.counts.add(keys.pool(session.pool), session.run, placed.increments(home))

    async def record_async(self, session: Session, record: TurnRecord, versions: tuple[int, int], placed: Placed,
                           conversation: Conversation | None, home: str | None, *, prefix_break: bool) -> None:
        """`record`, awaited."""
        if self._async is None:
            await anyio.to_thread.run_sync(functools.partial(self.record, session, record, versions, placed,
                                                             conversation, home, prefix_break=prefix_break))
            return
        where, args = self._record_call(session, record, versions, placed, conversation, prefix_break)
        if await self._async["record"](keys=where, args=args):
            self.counts.add(keys.pool(session.pool), session.run, placed.increments(home))

    @staticmethod
    def _record_call(session: Session, record: TurnRecord, versions: tuple[int, int], placed: Placed,
                     conversation: Conversation | None, prefix_break: bool) -> tuple[list[str], list[Any]]:
        now_ms = int(time.time() * 1000)
        ttl_set = now_ms if now_ms - session.ttl_set_ms >= TTL_REFRESH_S * 1000 else 0
        sid = session.session_id
        where = [keys.session(sid), keys.session_calls(sid), keys.session_ends(sid), keys.run_turn_stats(session.run)]
        return where, [record.turn, record.to_json(), placed.served_by, versions[0], versions[1], SESSION_TTL_S,
                       int(prefix_break), ttl_set, *record.index(conversation)]

    def reward(self, session_id: str, body: Any) -> Session:
        """Record `{"reward": x}`, `{"rewards": {name: x}}` (numbers) and/or `{"lineage_rewards": {call id: x}}`
        (a lineage's own reward, by its last call's id). Each reward named replaces its own earlier value and
        the others stay, so an agent worker ending the session with the episode's `{"reward": x}` keeps the
        `lineage_rewards` the harness posted before."""
        session = self.get(session_id)
        allowed = {"reward", "rewards", "lineage_rewards"}
        if not isinstance(body, dict) or set(body) - allowed or not body:
            raise APIError(400, 'a reward is {"reward": NUMBER}, {"rewards": {"NAME": NUMBER, ...}} and/or '
                                '{"lineage_rewards": {"CALL ID": NUMBER, ...}}', param="reward")
        values: dict[str, Any] = dict(body.get("rewards") or {})
        if "reward" in body:
            values["reward"] = body["reward"]
        lineages = body.get("lineage_rewards")
        if lineages is not None and not isinstance(lineages, dict):
            raise APIError(400, "lineage_rewards maps a call's id (the `id` of its answer) to a number",
                           param="lineage_rewards")
        for name, value in [*values.items(), *((f"lineage_rewards.{k}", v) for k, v in (lineages or {}).items())]:
            if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
                raise APIError(400, f"reward {name!r} must be a finite number, not {value!r}",
                               param=name if name.startswith("lineage_rewards.") else f"rewards.{name}")
        if lineages:
            values["lineage_rewards"] = {**((session.reward or {}).get("lineage_rewards") or {}), **lineages}
        merged = {**(session.reward or {}), **values}
        self.conn.hset(keys.session(session_id), "reward", json.dumps(merged))
        session.reward = merged
        return session

    def end(self, session_id: str) -> Session:
        """Close a session: its calls stay readable, those in flight are still answered and recorded;
        no new call is accepted."""
        session = self.get(session_id)
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(keys.session(session_id), "state", "ended")
            pipe.srem(keys.pool(session.pool).open_sessions, session_id)
            pipe.execute()
        session.state = "ended"
        return session
