"""A chat conversation's digests, which place a call in its session's tree of calls (`pipeline.serve.
sessions`: the reply keys of the index), and the conversations a server saw last, so that a call
validates, dumps and digests only the messages its session's previous call did not have.

The digest of the first `n + 1` messages chains the digest of the first `n` with message `n`'s, so
a conversation that extends one seen before reuses its digests: `Conversations.of` compares the
earlier messages with the new call's (a C-level comparison of the parsed dicts) and digests only
the rest (O(new messages), the JSON encoding and hashing being the per-message cost). A cache only:
a server that never saw the session (another server's, or evicted) digests the whole conversation,
to the same digests.

The same holds for validation (`Conversations.validated`): the messages a call shares with its
session's previous call, as parsed from the JSON, are that call's validated (frozen) models, so a
message is validated and dumped once per server, however many calls carry it.
"""

from __future__ import annotations

import hashlib
import json
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from pipeline.serve.protocol import ChatCompletionBody
from schemas.chat import ChatMessage

CACHED_SESSIONS = 1024  # conversations a server keeps (each holds its messages, as parsed)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(value: Any) -> str:
    """A stable digest of JSON-able data (sorted keys, no spaces)."""
    return hashlib.sha256(_ENCODER.encode(value).encode()).hexdigest()[:32]


def _chain(head: str, message_digest: str) -> str:
    return hashlib.sha256(f"{head}:{message_digest}".encode()).hexdigest()[:32]


def _dump(message: ChatMessage) -> dict[str, Any]:
    return message.model_dump(mode="json", exclude_none=True)


def _shared(a: Sequence[Any], b: Sequence[Any], same: Callable[[Any, Any], bool] = operator.eq) -> int:
    """How many leading items `a` and `b` share (`same`: equal, or `operator.is_` for the same objects),
    compared at C speed for the common case: `a` extends `b`."""
    n = min(len(a), len(b))
    if all(map(same, a[:n], b[:n])):
        return n
    return next(i for i in range(n) if not same(a[i], b[i]))


def _validated_after(data: dict[str, Any], known: Sequence[ChatMessage], rest: list[Any]) -> ChatCompletionBody:
    """`data` validated, its messages being `known` (validated before) followed by `rest`. Only `rest`
    is validated: pydantic would take the known models as they are but run their Python validators
    again. A body refused is validated whole again, so that its errors are located as the client
    sent it."""
    try:
        # The last known message stands in for the messages when none is new (a list may not be empty).
        tail = ChatCompletionBody.model_validate({**data, "messages": rest or [known[-1]]})
    except ValidationError:
        return ChatCompletionBody.model_validate(data)
    return tail.model_copy(update={"messages": [*known, *tail.messages] if rest else list(known)})


class Conversation:
    """Digests of a conversation's beginnings, each message encoded once; with `earlier` (a
    conversation these messages may extend), only the messages after it are."""

    def __init__(self, messages: list[dict[str, Any]], earlier: Conversation | None = None, *,
                 models: Sequence[ChatMessage] = ()) -> None:
        self.messages = messages
        self.models = models  # the validated messages `messages` are the dumps of (when known)
        self._heads = [""]
        self._replies: dict[int, str] = {}  # message index -> reply key of that assistant message
        self._assistants: list[int] = []  # the indices of the assistant messages
        if earlier is not None and len(earlier.messages) <= len(messages) \
                and messages[:len(earlier.messages)] == earlier.messages:
            self._heads = list(earlier._heads)
            self._replies = dict(earlier._replies)
            self._assistants = list(earlier._assistants)
        for i in range(len(self._heads) - 1, len(messages)):
            message = messages[i]
            self._heads.append(_chain(self._heads[-1], digest(message)))
            if message.get("role") == "assistant":
                self._assistants.append(i)

    def first(self, n: int) -> str:
        return self._heads[n]

    def whole(self) -> str:
        return self._heads[-1]

    def reply_key(self, n: int, assistant: dict[str, Any]) -> str:
        """The index field of the conversation's first `n` messages followed by `assistant` (a canonical
        assistant message): where a call that replied `assistant` after those messages is found."""
        return "m:" + _chain(self._heads[n], digest(assistant))

    def earlier_replies(self, canonical: Callable[[dict[str, Any]], dict[str, Any]]) -> list[str]:
        """The reply keys of the replies a parent may have sent: each assistant message followed by
        more (`canonical` reduces it to what identifies a reply), the latest first."""
        keys = []
        for j in reversed(self._assistants):
            if j == len(self.messages) - 1:  # the last message: nothing follows it
                continue
            key = self._replies.get(j)
            if key is None:
                key = self._replies[j] = self.reply_key(j, canonical(self.messages[j]))
            keys.append(key)
        return keys


class Conversations:
    """The conversation of each session's latest call this server saw, the least recently used
    dropped past `size`."""

    def __init__(self, size: int = CACHED_SESSIONS) -> None:
        self.size = size
        self._latest: OrderedDict[str, Conversation] = OrderedDict()
        # session -> its latest call's messages, as parsed and as validated
        self._bodies: OrderedDict[str, tuple[list[Any], Sequence[ChatMessage]]] = OrderedDict()
        self._lock = threading.Lock()

    def _remember(self, cache: OrderedDict[str, Any], session_id: str, value: Any) -> None:
        with self._lock:
            cache[session_id] = value
            cache.move_to_end(session_id)
            while len(cache) > self.size:
                cache.popitem(last=False)

    def validated(self, session_id: str | None, data: Any) -> ChatCompletionBody:
        """A chat call's body (JSON, parsed) validated; the messages it shares with its session's latest
        call are that call's models, not validated again."""
        raw = data.get("messages") if isinstance(data, dict) else None
        if session_id is None or not isinstance(raw, list):
            return ChatCompletionBody.model_validate(data)
        with self._lock:
            seen = self._bodies.get(session_id)
        n = _shared(raw, seen[0]) if seen is not None else 0
        body = _validated_after(data, seen[1][:n], raw[n:]) if n else ChatCompletionBody.model_validate(data)
        # The shared messages are kept as first parsed: this call's copies of them die young, so that a
        # call leaves only its new messages to the garbage collector's older generations (keeping each
        # call's whole parse made a full collection's cost grow with the conversations' length).
        self._remember(self._bodies, session_id, (seen[0][:n] + raw[n:] if n else raw, body.messages))
        return body

    def of(self, session_id: str | None, models: Sequence[ChatMessage]) -> Conversation:
        """The digests of a call's messages (`models`), a call of `session_id` (None: a session of one
        call); the messages the session's latest call had are not dumped again."""
        if session_id is None:
            return Conversation([_dump(m) for m in models], models=models)
        with self._lock:
            earlier = self._latest.get(session_id)
        known, dumps = (earlier.models, earlier.messages) if earlier is not None else ((), [])
        n = _shared(models, known, operator.is_)  # the models `validated` reused
        messages = [*dumps[:n], *(_dump(m) for m in models[n:])]
        conversation = Conversation(messages, earlier, models=models)
        self._remember(self._latest, session_id, conversation)
        return conversation
