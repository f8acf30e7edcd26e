"""Checkpoints of samples in flight, in one process: the binary pieces, the chains read back, and a
job's `Progress` saved and restored (fakeredis: nothing here crosses a process; the crashes are in
tests/workers/jobs/test_checkpoint_workers.py)."""

from __future__ import annotations

import struct

import fakeredis
import numpy as np
import pytest

from schemas.request import RolloutRequest
from workers.engines.base import INTERRUPTED, ContinuedRequest, Finish, SampleOutput
from workers.jobs.checkpoint import CheckpointError, CheckpointStore, chains, decode, encode
from workers.rows.continuation import Piece, Progress, Submission


def request(rid: str = "r", n: int = 1, max_new_tokens: int = 20, logprobs: int | None = 2,
            fields: dict[str, object] | None = None, **params: object) -> RolloutRequest:
    return RolloutRequest.model_validate({"id": rid, "input_ids": [1, 2, 3], "logprobs": logprobs, **(fields or {}),
                                          "sampling_params": {"max_new_tokens": max_new_tokens, "n": n, "seed": 7,
                                                              **params}})


def sample(ids: list[int], *, finish: Finish | None = None, version: int | None = None, k: int = 2) -> SampleOutput:
    return SampleOutput(
        token_ids=np.asarray(ids, np.int32), finish=finish or Finish("abort", message=INTERRUPTED),
        logprobs=np.asarray([-0.5 - t / 100 for t in ids], np.float32),
        top_logprobs=[[(t, -0.5 - t / 100), (t + 1, -2.0)][:k] for t in ids], weight_version=version)


def test_a_piece_round_trips_through_its_bytes() -> None:
    piece = Piece((3, 1), 40, 7, np.asarray([5, 6, 7], np.int32), np.asarray([-0.25, -1.5, -3.0], np.float32),
                  [[(5, -0.25), (9, -2.0)], [(6, -1.5), (1, -1.75)], [(7, -3.0), (2, -3.5)]],
                  finish=Finish("stop", matched=7))
    back, writer = decode(encode(piece, writer=99), "here")
    assert writer == 99 and back.slot == (3, 1) and (back.start, back.version) == (40, 7)
    assert back.token_ids.tolist() == [5, 6, 7] and back.logprobs is not None
    assert back.logprobs.tolist() == [-0.25, -1.5, -3.0]
    assert back.top_logprobs == piece.top_logprobs and back.finish == Finish("stop", matched=7)
    assert back.adapter_version is None  # on the base
    # 38-byte header, 8 bytes a token, 8 per top logprob, the finish's JSON.
    assert len(encode(piece, 99)) == 38 + 3 * 8 + 3 * 2 * 8 + len(b'["stop", 7]')


def test_a_piece_keeps_its_adapter_version_and_format_1_pieces_still_read() -> None:
    """A piece generated on a LoRA adapter keeps that adapter's version (a partial adapter push
    changes it mid-sample); a piece written before the field existed (format 1) reads as the base's."""
    on_adapter = Piece((0, 1), 3, 2, np.asarray([4, 5], np.int32), adapter_version=6)
    back, _ = decode(encode(on_adapter, 1), "here")
    assert (back.start, back.version, back.adapter_version) == (3, 2, 6)
    old = struct.pack("<BBHIIIIqIH", 1, 0, 0, 0, 1, 7, 3, 2, 2, 0) + np.asarray([4, 5], "<i4").tobytes()
    back, writer = decode(old, "here")
    assert writer == 7 and back.token_ids.tolist() == [4, 5] and back.adapter_version is None


def test_garbage_in_a_checkpoint_is_an_error_naming_the_job_and_element() -> None:
    good = encode(Piece((0, 0), 0, 0, np.asarray([1], np.int32)), 1)
    with pytest.raises(CheckpointError, match=r"job j1, element 1: not a checkpoint piece"):
        chains([good, good[:-1] + b"xx"], "j1")


def test_the_chain_keeps_one_writer_after_a_piece_that_does_not_fit() -> None:
    """Writer 2 resumed at 3; writer 1 (taken for dead, still running) appends from 3 too, later:
    its pieces are ignored from then on, and so are a writer's pieces after one that did not fit."""
    def piece(start: int, ids: list[int]) -> Piece:
        return Piece((0, 0), start, 0, np.asarray(ids, np.int32))

    elements = [encode(piece(0, [1, 2, 3]), 1), encode(piece(3, [4, 5]), 2), encode(piece(3, [9, 9]), 1),
                encode(piece(5, [6]), 2), encode(piece(6, [9]), 1)]
    (chain,) = chains(elements, "j").values()
    assert np.concatenate([p.token_ids for p in chain]).tolist() == [1, 2, 3, 4, 5, 6]
    assert [p.writer for p in chain] == [1, 2, 2]


def test_progress_saves_only_what_is_new_and_restores_it_elsewhere() -> None:
    """Checkpoint twice mid-sample, record a swap, checkpoint the finish of one sample; a new Progress
    takes it back: the finished sample done, the other continued from its last saved token."""
    store = CheckpointStore(fakeredis.FakeRedis())
    req = request(n=2, max_new_tokens=20)
    first = Progress([req])
    submission = first.first(0)

    def save(pieces: list[Piece], writer: int = 1) -> list[Piece]:
        store.save([("job", writer, pieces)])
        first.mark_saved(pieces)
        return pieces

    pieces = save(first.unsaved((submission, [[sample([10, 11]), sample([20])]])))
    assert [(p.slot, p.start, len(p.token_ids)) for p in pieces] == [((0, 0), 0, 2), ((0, 1), 0, 1)]
    pieces = save(first.unsaved((submission, [[sample([10, 11, 12]), sample([20])]])))
    assert [(p.slot, p.start, p.token_ids.tolist()) for p in pieces] == [((0, 0), 2, [12])]  # only the new
    # A partial swap: both stopped (v0), sample 1 continues on v1 and finishes there.
    first.record(submission, [[sample([10, 11, 12, 13]), sample([20, 21])]])
    save(first.unsaved())
    resumed = first.resume(1)
    assert resumed.slots == [[(0, 0)], [(0, 1)]]
    first.record(Submission(resumed.requests, slots=resumed.slots, version=1),
                 [[sample([14])], [sample([22, 0], finish=Finish("stop", matched=0))]])
    save(first.unsaved())
    # A new worker (another writer) takes the checkpoint back.
    second = Progress([req])
    assert second.restore(store.load("job")) == 2 and second.unfinished == 1
    submission = second.resume(2, untouched_whole=True)
    (continued,) = submission.requests
    assert isinstance(continued, ContinuedRequest) and submission.slots == [[(0, 0)]]
    assert continued.input_ids == [1, 2, 3, 10, 11, 12, 13, 14] and continued.generated == 5
    assert continued.sampling_params.max_new_tokens == 15 and continued.sample_index == 0
    second.record(submission, [[sample([15, 0], finish=Finish("stop", matched=0), version=2)]])
    a, b = second.outputs(None)[0]
    assert a.token_ids.tolist() == [10, 11, 12, 13, 14, 15, 0]
    assert a.version_segments == [(0, 0), (4, 1), (5, 2)] and a.resumed_at == [5]
    assert a.logprobs is not None and len(a.logprobs) == 7 and a.top_logprobs is not None
    assert b.token_ids.tolist() == [20, 21, 22, 0] and b.finish == Finish("stop", matched=0)
    assert b.version_segments == [(0, 0), (2, 1)] and b.resumed_at is None  # finished before the crash


def test_samples_that_cannot_continue_exactly_are_not_checkpointed() -> None:
    """Penalties, prompt logprobs and routed experts: no pieces, so they start from the prompt."""
    requests = [request("pen", repetition_penalty=1.2), request("plp", fields={"prompt_logprobs": 0}),
                request("moe", fields={"return_routed_experts": True})]
    progress = Progress(requests)
    submission = progress.first(0)
    assert progress.unsaved((submission, [[sample([1, 2])] for _ in requests])) == []


def test_a_restarted_sample_resets_its_chain() -> None:
    """The staleness bound drops a sample's tokens: the next checkpoint starts its chain over."""
    store = CheckpointStore(fakeredis.FakeRedis())
    progress = Progress([request()], max_staleness=0)
    submission = progress.first(0)
    progress.record(submission, [[sample([5, 6, 7])]])
    pieces = progress.unsaved()
    store.save([("job", 1, pieces)])
    progress.mark_saved(pieces)
    resumed = progress.resume(1)  # v0 tokens are too stale at v1: dropped, from the prompt
    assert resumed.requests[0].input_ids == [1, 2, 3]
    progress.record(resumed, [[sample([8], version=1)]])
    pieces = progress.unsaved()
    assert pieces[0].reset and pieces[0].start == 0
    store.save([("job", 1, pieces)])
    (chain,) = store.load("job").values()
    assert [p.token_ids.tolist() for p in chain] == [[8]] and chain[0].version == 1
