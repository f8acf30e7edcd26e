"""Checkpoints of samples in flight: what a worker saves in Redis so a job survives its death.

A worker saves each unfinished sample's progress every `--checkpoint-every` seconds and at every
partial swap (`workers.jobs.feeder`): the tokens generated since its last checkpoint, with their
logprobs, top logprobs and weight version (`workers.rows.continuation.Piece`). The worker that
takes the job after a crash (a hand-back, or RQ's abandoned-job retry) loads them and continues
each sample from where it was saved (`Progress.restore`) instead of generating it again.

Layout: one Redis list per job (`keys.checkpoint(job_id)`), one element per piece, appended with
RPUSH (only what is new since the last checkpoint), binary-packed (never pickle):

    header  <BBHIIIIqIHI magic, flags, k (top logprobs per token), request index, sample index,
                         writer, start (completion offset), weight version, tokens, finish bytes,
                         LoRA adapter version (0: the base)
    ids     int32 x tokens
    logprobs float32 x tokens                     (flag LOGPROBS)
    top ids int32 x tokens*k, top logprobs float32 x tokens*k
    finish  JSON [kind, matched]                  (flag FINISHED: the sample ended with this piece)

A job whose requests name LoRA adapters also keeps, beside its list, the adapter versions its
samples run on now (`keys.checkpoint_adapters`: JSON name -> version, written with each save; a
partial adapter push moves them on): the worker that resumes it pins those versions again
(`workers.jobs.adapters.repin`), so a sample continues on the version it ran on, not on one pushed
since, and each piece's own adapter version keeps the provenance of the tokens before.

A piece with flag RESET starts its sample over (it was restarted from the prompt: penalties, the
staleness bound). The list expires `CHECKPOINT_TTL_S` after its last write and is deleted when the
job commits (`workers.jobs.batch_job.commit_batch`).

Reading keeps, per sample, one chain of pieces from offset 0: a piece is taken only if it starts
where the chain ends; a writer (one execution of the job: crc32 of its execution id) one of whose
pieces did not fit is ignored from then on. So a worker RQ took for dead while it still ran (its
heartbeats lost in a failover) cannot splice its tokens into the chain of the worker that resumed
the job. Whatever does not decode is an error naming the job and the element (`CheckpointError`):
a job's checkpoint is written only by this module.

Cost: per checkpointed token 8 bytes (+ 8 per top logprob) plus a 38-byte header and Redis's list
overhead per piece; per worker one pipelined RPUSH + EXPIRE per job with new tokens per interval
(`benchmarks/checkpoints.py` measures both).
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import redis

from pipeline.core.broker import keys
from workers.engines.base import Finish
from workers.errors import CheckpointError
from workers.rows.continuation import Piece

DEFAULT_CHECKPOINT_EVERY_S = 10.0
CHECKPOINT_TTL_S = 24 * 3600

MAGIC = 2
LOGPROBS = 1
RESET = 2
FINISHED = 4
_HEADER = struct.Struct("<BBHIIIIqIHI")
_HEADER_V1 = struct.Struct("<BBHIIIIqIH")  # format 1: no adapter version (pieces on the base, or from before)




def writer_id(execution_id: str) -> int:
    """The writer tag of one execution of a job."""
    return zlib.crc32(execution_id.encode())


def encode(piece: Piece, writer: int) -> bytes:
    """One piece as a list element (see the module doc)."""
    count = len(piece.token_ids)
    flags = (LOGPROBS if piece.logprobs is not None else 0) | (RESET if piece.reset else 0)
    finish = b""
    if piece.finish is not None:
        flags |= FINISHED
        finish = json.dumps([piece.finish.kind, piece.finish.matched]).encode()
    tops = piece.top_logprobs
    k = len(tops[0]) if tops else 0
    parts = [_HEADER.pack(MAGIC, flags, k, piece.slot[0], piece.slot[1], writer, piece.start, piece.version,
                          count, len(finish), piece.adapter_version or 0),
             np.asarray(piece.token_ids, dtype="<i4").tobytes()]
    if piece.logprobs is not None:
        parts.append(np.asarray(piece.logprobs, dtype="<f4").tobytes())
    if k:
        assert tops is not None
        parts.append(np.asarray([[t for t, _ in position] for position in tops], dtype="<i4").tobytes())
        parts.append(np.asarray([[lp for _, lp in position] for position in tops], dtype="<f4").tobytes())
    parts.append(finish)
    return b"".join(parts)


def decode(data: bytes, where: str) -> tuple[Piece, int]:
    """A list element back to its piece and writer; `CheckpointError` naming `where` if it is not one."""
    header = _HEADER_V1 if data[:1] == b"\x01" else _HEADER
    if len(data) < header.size:
        raise CheckpointError(f"{where}: {len(data)} bytes, shorter than a checkpoint header ({header.size})")
    magic, flags, k, r, i, writer, start, version, count, finish_len, *adapter = header.unpack_from(data)
    lp_len = 4 * count if flags & LOGPROBS else 0
    expected = header.size + 4 * count + lp_len + 8 * count * k + finish_len
    if magic not in (1, MAGIC) or len(data) != expected:
        raise CheckpointError(f"{where}: not a checkpoint piece (format {magic}, {len(data)} bytes for "
                              f"{count} tokens, expected {expected}); delete the key to regenerate its samples")
    at = header.size
    ids = np.frombuffer(data, dtype="<i4", count=count, offset=at).astype(np.int32)
    at += 4 * count
    logprobs = None
    if flags & LOGPROBS:
        logprobs = np.frombuffer(data, dtype="<f4", count=count, offset=at).astype(np.float32)
        at += lp_len
    tops = None
    if k:
        top_ids = np.frombuffer(data, dtype="<i4", count=count * k, offset=at).reshape(count, k)
        at += 4 * count * k
        top_lps = np.frombuffer(data, dtype="<f4", count=count * k, offset=at).reshape(count, k)
        at += 4 * count * k
        tops = [list(zip(a.tolist(), b.tolist(), strict=True)) for a, b in zip(top_ids, top_lps, strict=True)]
    finish = None
    if flags & FINISHED:
        try:
            kind, matched = json.loads(data[at:at + finish_len])
        except ValueError as exc:
            raise CheckpointError(f"{where}: its finish does not decode ({exc})") from None
        finish = Finish(kind, matched=matched)
    piece = Piece(slot=(r, i), start=start, version=version, token_ids=ids, logprobs=logprobs, top_logprobs=tops,
                  finish=finish, reset=bool(flags & RESET), writer=writer,
                  adapter_version=adapter[0] if adapter and adapter[0] else None)
    return piece, writer


def chains(elements: Sequence[bytes], job_id: str) -> dict[tuple[int, int], list[Piece]]:
    """Per sample (request index, sample index), its chain of pieces from offset 0 (see the module doc)."""
    found: dict[tuple[int, int], list[Piece]] = {}
    lengths: dict[tuple[int, int], int] = {}
    banned: set[tuple[tuple[int, int], int]] = set()
    for index, data in enumerate(elements):
        piece, writer = decode(data, f"checkpoint of job {job_id}, element {index}")
        slot = piece.slot
        if (slot, writer) in banned:
            continue
        if piece.reset and piece.start == 0:
            found[slot], lengths[slot] = [], 0
        chain = found.setdefault(slot, [])
        if piece.start != lengths.get(slot, 0) or (chain and chain[-1].finish is not None):
            banned.add((slot, writer))
            continue
        chain.append(piece)
        lengths[slot] = piece.start + len(piece.token_ids)
    return {slot: chain for slot, chain in found.items() if chain}


class CheckpointStore:
    """A job's checkpoint in Redis: appended to, read back, deleted."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def save(self, saves: Sequence[tuple[str, int, Sequence[Piece]]],
             adapters: Mapping[str, Mapping[str, int]] | None = None) -> int:
        """Append each job's pieces (`(job id, writer, pieces)`) in one round trip, with the adapter
        versions the jobs in `adapters` run on now (job id -> name -> version); the bytes written."""
        written = 0
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id, writer, pieces in saves:
                if not pieces:
                    continue
                elements = [encode(piece, writer) for piece in pieces]
                written += sum(len(e) for e in elements)
                key = keys.checkpoint(job_id)
                pipe.rpush(key, *elements)
                pipe.expire(key, CHECKPOINT_TTL_S)
                pins = (adapters or {}).get(job_id)
                if pins:
                    pins_key = keys.checkpoint_adapters(job_id)
                    pipe.set(pins_key, json.dumps(dict(pins), sort_keys=True))
                    pipe.expire(pins_key, CHECKPOINT_TTL_S)
            pipe.execute()
        return written

    def load(self, job_id: str) -> dict[tuple[int, int], list[Piece]]:
        return chains(self.conn.lrange(keys.checkpoint(job_id), 0, -1), job_id)

    def load_adapters(self, job_id: str) -> dict[str, int] | None:
        """The adapter versions the job's checkpointed tokens came from (None: none recorded)."""
        raw = self.conn.get(keys.checkpoint_adapters(job_id))
        if raw is None:
            return None
        try:
            pins = json.loads(raw)
        except ValueError:
            pins = None
        if not isinstance(pins, dict) or not all(isinstance(k, str) and type(v) is int for k, v in pins.items()):
            raise CheckpointError(f"job {job_id}: {keys.checkpoint_adapters(job_id)} is not a JSON object of adapter "
                                  "versions; it is written only by the worker's checkpoints")
        return pins

    def delete(self, job_id: str) -> None:
        self.conn.delete(keys.checkpoint(job_id), keys.checkpoint_adapters(job_id))
