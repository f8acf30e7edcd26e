"""A chat conversation's digests, which place a call in its session's tree of calls (`pipeline.serve.
sessions`: the reply keys of the index), and the conversations a server saw last, so that a call
digests only the messages its session's previous call did not have.

The digest of the first `n + 1` messages chains the digest of the first `n` with message `n`'s, so
a conversation that extends one seen before reuses its digests: `Conversations.of` compares the
earlier messages with the new call's (a C-level comparison of the parsed dicts) and digests only
the rest (O(new messages), the JSON encoding and hashing being the per-message cost). A cache only:
a server that never saw the session (another server's, or evicted) digests the whole conversation,
to the same digests.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

CACHED_SESSIONS = 1024  # conversations a server keeps (each holds its messages, as parsed)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(value: Any) -> str:
    """A stable digest of JSON-able data (sorted keys, no spaces)."""
    return hashlib.sha256(_ENCODER.encode(value).encode()).hexdigest()[:32]


def _chain(head: str, message_digest: str) -> str:
    return hashlib.sha256(f"{head}:{message_digest}".encode()).hexdigest()[:32]


class Conversation:
    """Digests of a conversation's beginnings, each message encoded once; with `earlier` (a
    conversation these messages may extend), only the messages after it are."""

    def __init__(self, messages: list[dict[str, Any]], earlier: Conversation | None = None) -> None:
        self.messages = messages
        self._heads = [""]
        self._replies: dict[int, str] = {}  # message index -> reply key of that assistant message
        if earlier is not None and len(earlier.messages) <= len(messages) \
                and messages[:len(earlier.messages)] == earlier.messages:
            self._heads = list(earlier._heads)
            self._replies = dict(earlier._replies)
        for message in messages[len(self._heads) - 1:]:
            self._heads.append(_chain(self._heads[-1], digest(message)))

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
        for j in range(len(self.messages) - 2, -1, -1):
            if self.messages[j].get("role") != "assistant":
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
        self._lock = threading.Lock()

    def of(self, session_id: str | None, messages: list[dict[str, Any]]) -> Conversation:
        """The digests of `messages`, a call of `session_id` (None: a session of one call)."""
        if session_id is None:
            return Conversation(messages)
        with self._lock:
            earlier = self._latest.get(session_id)
        conversation = Conversation(messages, earlier)
        with self._lock:
            self._latest[session_id] = conversation
            self._latest.move_to_end(session_id)
            while len(self._latest) > self.size:
                self._latest.popitem(last=False)
        return conversation
