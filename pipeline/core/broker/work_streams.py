"""Work handed to live consumers through Redis Streams consumer groups: the one mechanism behind a
worker's own turns (`pipeline.core.jobs.turn_queue`) and agent workers' episodes
(`pipeline.core.jobs.episodes`). RQ serves the batch jobs trainers submit; everything routed to a
consumer that is alive now goes through here.

A job is one JSON field of a stream entry. A consumer group hands each entry to one consumer and
keeps it in the group's pending list until that consumer acknowledges it (`acknowledge`: XACK and
XDEL, so a stream holds only what is queued or running). A consumer keeps the entries it holds
fresh (`keep_claimed`, XCLAIM of its own entries, every few seconds); an entry whose holder stopped
doing so (SIGKILLed, its host gone) goes idle, and another consumer takes it over (`take_over`,
XAUTOCLAIM past a claim-after time). A consumer that stops on purpose hands its entries back
(`hand_back`): they look idle for ever, so the next take-over takes them at once. Redis's pending
list is the record of who holds what: nothing here is a home-made broker.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import redis
from redis.client import Pipeline

log = logging.getLogger(__name__)

JOB_FIELD = b"job"
SCAN_PENDING = 1000  # pending entries looked at per take-over from gone consumers
HANDED_BACK_IDLE_MS = 10**9  # a handed-back entry looks idle this long: any consumer takes it over at once

J = TypeVar("J")


@dataclass(frozen=True)
class Claimed(Generic[J]):
    """An entry a consumer holds: its stream, id and job."""

    stream: str
    entry_id: str
    job: J


class WorkStreams(Generic[J]):
    """The streams read through one consumer group, `group`, whose entries hold jobs `decode` reads."""

    def __init__(self, group: str, decode: Callable[[bytes], J]) -> None:
        self.group = group
        self.decode = decode

    def ensure_group(self, conn: redis.Redis | Pipeline, stream: str) -> None:
        """Create the stream's consumer group (and the stream) unless it exists; from the stream's
        start, so entries added before it are handed out too."""
        try:
            conn.xgroup_create(stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    @staticmethod
    def add(pipe: redis.Redis | Pipeline, stream: str, job_json: str | bytes) -> None:
        """Queue a job (its JSON) at the end of `stream`."""
        pipe.xadd(stream, {JOB_FIELD: job_json})

    def _claimed(self, conn: redis.Redis, stream: str,
                 entries: list[tuple[bytes, dict[bytes, bytes]] | None]) -> list[Claimed[J]]:
        """Entries read or claimed, as jobs. One deleted while pending (no fields) is acknowledged: nothing
        to run. One that is no job of this project's (unreadable) is logged, acknowledged and deleted."""
        claimed: list[Claimed[J]] = []
        gone: list[bytes | str] = []
        bad: list[bytes | str] = []
        for item in entries:
            if item is None:  # an entry deleted while pending, as some Redis versions answer XCLAIM
                continue
            entry_id, fields = item
            entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if not fields:
                gone.append(entry)
                continue
            try:
                claimed.append(Claimed(stream, entry, self.decode(fields[JOB_FIELD])))
            except (KeyError, TypeError, ValueError) as exc:
                log.error("dropped entry %s of %s: not a job (%s): %.200r", entry, stream, exc, fields)
                bad.append(entry)
        if gone or bad:
            with conn.pipeline(transaction=True) as pipe:
                pipe.xack(stream, self.group, *gone, *bad)
                if bad:
                    pipe.xdel(stream, *bad)
                pipe.execute()
        return claimed

    def acknowledge(self, pipe: Pipeline, claimed: Claimed[J]) -> None:
        """The entry is done: it leaves the pending list and the stream (in the caller's pipeline)."""
        pipe.xack(claimed.stream, self.group, claimed.entry_id)
        pipe.xdel(claimed.stream, claimed.entry_id)

    def keep_claimed(self, conn: redis.Redis, consumer: str, held: list[Claimed[J]]) -> None:
        """Reset the idle time of the entries `consumer` holds, so nobody takes them over."""
        by_stream: dict[str, list[str]] = {}
        for claimed in held:
            by_stream.setdefault(claimed.stream, []).append(claimed.entry_id)
        with conn.pipeline(transaction=False) as pipe:
            for stream, ids in by_stream.items():
                pipe.xclaim(stream, self.group, consumer, 0, ids, justid=True)
            pipe.execute()

    def hand_back(self, pipe: Pipeline, consumer: str, claimed: Claimed[J]) -> None:
        """Make a held entry look idle for ever: the next take-over, by any consumer, takes it."""
        pipe.xclaim(claimed.stream, self.group, consumer, 0, [claimed.entry_id], idle=HANDED_BACK_IDLE_MS,
                    justid=True)

    def take_over(self, conn: redis.Redis, stream: str, consumer: str, idle_ms: int, count: int) -> list[Claimed[J]]:
        """Up to `count` entries of `stream` whose holder has not kept them for `idle_ms` (it died, or
        handed them back), now `consumer`'s."""
        entries = conn.xautoclaim(stream, self.group, consumer, idle_ms, start_id="0-0", count=count)[1]
        return self._claimed(conn, stream, entries)

    def take_over_from(self, conn: redis.Redis, stream: str, consumer: str, gone: Callable[[str], bool],
                       count: int, *, idle_ms: int = 1000) -> list[Claimed[J]]:
        """Up to `count` entries of `stream` held by consumers known to be gone (`gone(name)`), now
        `consumer`'s, without waiting for a claim-after time. `idle_ms` keeps two consumers taking
        over at once from taking each other's: an entry just claimed is not idle."""
        pending = conn.xpending_range(stream, self.group, min="-", max="+", count=max(count, SCAN_PENDING),
                                      idle=idle_ms)
        ids = [p["message_id"] for p in pending if gone(p["consumer"].decode())][:count]
        if not ids:
            return []
        return self._claimed(conn, stream, conn.xclaim(stream, self.group, consumer, idle_ms, ids))

    def read_new(self, conn: redis.Redis, streams: list[str], consumer: str, count: int,
                 block_ms: int | None) -> list[Claimed[J]]:
        """Up to `count` entries no consumer has had yet, across all `streams` together, blocking up to
        `block_ms` for the first (None: not at all; never 0, which blocks forever).

        XREADGROUP's COUNT bounds each stream, not the read: one read of several streams would hand
        this consumer up to `count` of each. So the streams are read one by one (from a random one,
        so that no stream's backlog starves another's) until `count` are had. A single stream is
        read blocking at once; with none had from several, they are waited on with a plain XREAD
        from each group's last delivered entry, which hands out nothing, then read again."""
        if len(streams) == 1 and block_ms is not None:  # one command, whether an entry waits or not
            answer = conn.xreadgroup(self.group, consumer, {streams[0]: ">"}, count=count, block=block_ms)
            return self._claimed(conn, streams[0], [entry for _, entries in answer or [] for entry in entries])
        claimed = self._read_each(conn, streams, consumer, count)
        if claimed or block_ms is None or not streams:
            return claimed
        with conn.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xinfo_groups(stream)
            infos = pipe.execute()
        group = self.group.encode()
        delivered = {stream: next((g["last-delivered-id"] for g in groups if g["name"] in (self.group, group)), "0")
                     for stream, groups in zip(streams, infos, strict=True)}
        if conn.xread(delivered, count=1, block=block_ms):
            claimed = self._read_each(conn, streams, consumer, count)
        return claimed

    def read_one_each(self, conn: redis.Redis, streams: list[str], consumer: str, block_ms: int) -> list[Claimed[J]]:
        """At most one entry no consumer has had yet from each of `streams`, in one XREADGROUP that blocks
        up to `block_ms` (never 0) for the first."""
        answer = conn.xreadgroup(self.group, consumer, dict.fromkeys(streams, ">"), count=1, block=block_ms)
        return [claimed for stream, entries in answer or []
                for claimed in self._claimed(conn, stream.decode() if isinstance(stream, bytes) else stream, entries)]

    def _read_each(self, conn: redis.Redis, streams: list[str], consumer: str, count: int) -> list[Claimed[J]]:
        claimed: list[Claimed[J]] = []
        start = random.randrange(len(streams)) if streams else 0
        for stream in streams[start:] + streams[:start]:
            if len(claimed) >= count:
                break
            answer = conn.xreadgroup(self.group, consumer, {stream: ">"}, count=count - len(claimed))
            claimed += self._claimed(conn, stream, [entry for _, entries in answer or [] for entry in entries])
        return claimed

    def backlog(self, conn: redis.Redis, streams: list[str]) -> tuple[int, int]:
        """(entries held by a consumer, entries not yet handed out) across `streams`."""
        pending = lag = 0
        group = self.group.encode()
        for stream in streams:
            try:
                groups = conn.xinfo_groups(stream)
            except redis.ResponseError:  # no such stream
                continue
            for info in groups:
                if info["name"] in (self.group, group):
                    pending += int(info["pending"])
                    lag += int(info.get("lag") or 0)
        return pending, lag
