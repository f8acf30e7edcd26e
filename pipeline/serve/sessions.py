"""Agent sessions in Redis: what a server needs to serve a session's next turn, and nothing in memory.

A session (`keys.session`) is a hash: its run, pool and output, metadata, the LoRA adapter every
turn of it runs on (if any), state (`open` or
`ended`), the number of turns committed, the reward, the weight versions its turns used, and
two JSON records: `last`, the last committed turn (its prompt ids, each choice's completion ids
and assistant message, and the answer sent, so a retried call is answered again, not generated
again), and `pending`, the turn in flight (claimed with HSETNX, so two servers never run the
same turn twice). Any server can serve any turn; a restarted server loses nothing.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from pipeline.core import adapters
from pipeline.core.broker import keys
from pipeline.core.errors import AdapterError
from pipeline.serve.api_error import APIError
from pipeline.serve.turn_counts import TurnCounts

SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SESSION_TTL_S = 7 * 24 * 3600  # an idle session's state expires 6-7 days after its last turn:
TTL_REFRESH_S = 24 * 3600  # its expiry is pushed back by a turn once it was set this long ago
# KEYS: the session, the run's turn counts. ARGV: the turn record (`last`), the session's turns, its
# home, the lowest and highest weight version of the session's turns with this one, the session's
# TTL, 1 if the turn broke the session's prefix, the time (ms) to note the TTL as set at, or 0 to
# leave it (set less than `TTL_REFRESH_S` ago). The turn becomes `last`, the pending mark goes, a
# prefix break is counted: one script, atomic.
_RECORD = """
local fields = {'last', ARGV[1], 'turns', ARGV[2], 'home', ARGV[3], 'min_version', ARGV[4], 'max_version', ARGV[5]}
if ARGV[8] ~= '0' then
  table.insert(fields, 'ttl_set_ms')
  table.insert(fields, ARGV[8])
  redis.call('EXPIRE', KEYS[1], ARGV[6])
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('HDEL', KEYS[1], 'pending')
if ARGV[7] == '1' then
  redis.call('HINCRBY', KEYS[2], 'prefix_breaks', 1)
  redis.call('HINCRBY', KEYS[1], 'prefix_breaks', 1)
end
"""

# KEYS: the session. ARGV: the pending turn. -1 when the session is no longer open, else HSETNX's answer:
# a turn is claimed only while its session is open, so a session ended meanwhile starts no turn.
_CLAIM = """
if redis.call('HGET', KEYS[1], 'state') ~= 'open' then return -1 end
return redis.call('HSETNX', KEYS[1], 'pending', ARGV[1])
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


def digest(value: Any) -> str:
    """A stable digest of JSON-able data (sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ConversationDigests:
    """Digests of a conversation and of each of its beginnings, each message encoded once: the
    digest of the first `n` messages is the digest of their `n` digests."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self._each = [digest(m) for m in messages]

    def first(self, n: int) -> str:
        return digest(self._each[:n])

    def whole(self) -> str:
        return self.first(len(self._each))


def pack_ids(ids: Any) -> str:
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode("ascii")


def unpack_ids(packed: str) -> list[int]:
    return np.frombuffer(base64.b64decode(packed), dtype="<i4").tolist()


@dataclass
class Choice:
    """One sample of a committed turn, as the next turn needs it."""

    completion_ids: list[int]
    completion_text: str  # decoded with special tokens: what the template's glue is matched against
    assistant: dict[str, Any]  # the canonical assistant message sent (`canonical_assistant`)

    def to_json(self) -> dict[str, Any]:
        return {"ids": pack_ids(self.completion_ids), "text": self.completion_text, "assistant": self.assistant}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Choice:
        return cls(unpack_ids(data["ids"]), data["text"], data["assistant"])


@dataclass
class TurnRecord:
    """The last committed turn of a session."""

    turn: int
    turn_id: str
    request_digest: str
    messages_digest: str
    n_messages: int
    prompt_ids: list[int]
    prompt_text: str | None
    choices: list[Choice]
    response: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps({
            "turn": self.turn, "turn_id": self.turn_id, "request_digest": self.request_digest,
            "messages_digest": self.messages_digest, "n_messages": self.n_messages,
            "prompt_ids": pack_ids(self.prompt_ids), "prompt_text": self.prompt_text,
            "choices": [c.to_json() for c in self.choices], "response": self.response,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> TurnRecord:
        data = json.loads(raw)
        return cls(data["turn"], data["turn_id"], data["request_digest"], data["messages_digest"], data["n_messages"],
                   unpack_ids(data["prompt_ids"]), data["prompt_text"],
                   [Choice.from_json(c) for c in data["choices"]], data["response"])


@dataclass(frozen=True)
class Pending:
    """A turn in flight: enough for any server to wait for it and record it."""

    turn: int
    turn_id: str
    request_digest: str
    messages_digest: str
    n_messages: int
    prefix_break: bool

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
        """The turn's part in the pool's affinity counts (`keys.PoolKeys.lane_stats`): turns; turns of a
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
    turns: int
    metadata: dict[str, Any] = field(default_factory=dict)
    last: TurnRecord | None = None
    pending: Pending | None = None
    reward: dict[str, Any] | None = None
    min_version: int | None = None
    max_version: int | None = None
    ephemeral: bool = False
    home: str | None = None  # the worker that served its last turn (`pipeline.core.affinity`)
    ttl_set_ms: int = 0  # when its expiry was last set (`TTL_REFRESH_S`)
    adapter: str | None = None  # the LoRA adapter every turn runs on (None: the base weights)

    def public(self) -> dict[str, Any]:
        """The session as `GET /sessions/<id>` shows it."""
        return {"session_id": self.session_id, "run": self.run, "pool": self.pool, "state": self.state,
                "turns": self.turns, "metadata": self.metadata, "adapter": self.adapter, "reward": self.reward,
                "weight_versions": None if self.min_version is None else [self.min_version, self.max_version],
                "turn_in_flight": None if self.pending is None else self.pending.turn}


class SessionStore:
    """Sessions of one Redis (sync client; the server calls it from worker threads)."""

    def __init__(self, conn: redis.Redis, counts: TurnCounts | None = None) -> None:
        self.conn = conn
        # The pool's turn counts: written in batches by a server, with each turn by default.
        self.counts = counts or TurnCounts(conn, every_s=0)
        self._record = conn.register_script(_RECORD)
        self._claim = conn.register_script(_CLAIM)

    def create(self, *, run: str, pool: str, output: str, metadata: dict[str, Any] | None = None,
               session_id: str | None = None, ephemeral: bool = False, adapter: str | None = None) -> Session:
        """A new open session (409 if `session_id` is taken; 400 if the pool has no adapter `adapter`)."""
        session_id = check_session_id(session_id) if session_id else new_session_id("call" if ephemeral else "s")
        where = keys.pool(pool)
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
                  "ephemeral": int(ephemeral), **({"adapter": adapter} if adapter is not None else {})}
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
                       ttl_set_ms=now_ms, adapter=adapter)

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
            days = f"{(SESSION_TTL_S - TTL_REFRESH_S) // 86400}-{SESSION_TTL_S // 86400}"
            raise APIError(404, f"no session {session_id!r}: create it with POST /sessions (it may have expired "
                                f"{days} days after its last turn)", param="session_id", code="session_not_found")
        data = {k.decode(): v.decode() for k, v in raw.items()}
        return Session(
            session_id, data["run"], data["pool"], data["output"], data["state"], int(data["turns"]),
            json.loads(data.get("metadata") or "{}"),
            TurnRecord.from_json(data["last"]) if "last" in data else None,
            Pending.from_json(data["pending"]) if "pending" in data else None,
            json.loads(data["reward"]) if "reward" in data else None,
            int(data["min_version"]) if "min_version" in data else None,
            int(data["max_version"]) if "max_version" in data else None,
            data.get("ephemeral") == "1",
            data.get("home"),
            int(data.get("ttl_set_ms") or 0),
            data.get("adapter"),
        )

    def claim(self, session: Session, pending: Pending) -> bool:
        """Mark `pending` in flight; False if another turn got there first; 409 if the session has ended
        since it was read (its episode was canceled: `pipeline.core.jobs.episodes.cancel_run`)."""
        claimed = int(self._claim(keys=[keys.session(session.session_id)], args=[pending.to_json()]))
        if claimed < 0:
            raise ended(session.session_id)
        return bool(claimed)

    def release(self, session: Session, pending: Pending) -> None:
        """Drop a pending turn that will not be recorded (its job failed or could not be enqueued)."""
        key = keys.session(session.session_id)
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.watch(key)
            if pipe.hget(key, "pending") == pending.to_json().encode():
                pipe.multi()
                pipe.hdel(key, "pending")
                pipe.execute()

    def record(self, session: Session, pending: Pending, record: TurnRecord, versions: tuple[int, int],
               placed: Placed) -> None:
        """Commit a turn to the session: it becomes `last`, the pending mark goes, counts move, the
        weight versions its turns used widen, and the worker that served it becomes the session's
        home (the pool's affinity counts move with it, at once or in `counts`' next batch). `session`
        is the session as read when the turn began (its weight versions and expiry are taken from it)."""
        # The session's range as read when its turn began: no other turn of it ran since (its pending mark).
        low, high = versions
        if session.min_version is not None and session.max_version is not None:
            low, high = min(low, session.min_version), max(high, session.max_version)
        now_ms = int(time.time() * 1000)
        ttl_set = now_ms if now_ms - session.ttl_set_ms >= TTL_REFRESH_S * 1000 else 0
        self._record(keys=[keys.session(session.session_id), keys.run_turn_stats(session.run)],
                     args=[record.to_json(), pending.turn + 1, placed.served_by, low, high, SESSION_TTL_S,
                           int(pending.prefix_break), ttl_set])
        self.counts.add(keys.pool(session.pool), session.run, placed.increments(session.home))

    def reward(self, session_id: str, body: Any) -> Session:
        """Record `{"reward": x}` or `{"rewards": {name: x}}` (numbers); replaces an earlier reward."""
        session = self.get(session_id)
        if not isinstance(body, dict) or set(body) - {"reward", "rewards"} or not body:
            raise APIError(400, 'a reward is {"reward": NUMBER} or {"rewards": {"NAME": NUMBER, ...}}', param="reward")
        values = dict(body.get("rewards") or {})
        if "reward" in body:
            values["reward"] = body["reward"]
        for name, value in values.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
                raise APIError(400, f"reward {name!r} must be a finite number, not {value!r}", param=f"rewards.{name}")
        self.conn.hset(keys.session(session_id), "reward", json.dumps(values))
        session.reward = values
        return session

    def end(self, session_id: str) -> Session:
        """Close a session: its turns stay readable; no new turn is accepted."""
        session = self.get(session_id)
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.hset(keys.session(session_id), "state", "ended")
            pipe.srem(keys.pool(session.pool).open_sessions, session_id)
            pipe.execute()
        session.state = "ended"
        return session
