"""`workers.jobs.turn_streams` over `Progress.so_far`: each token published once, in order, across a
partial swap's continuation; samples with penalties are not streamed."""

from __future__ import annotations

import numpy as np

from pipeline.core.jobs.turn_stream import TokenDelta
from schemas.job_payload import TurnTag
from schemas.request import RolloutRequest
from workers.engines.base import INTERRUPTED, Finish, SampleOutput
from workers.jobs.turn_streams import TurnStreams
from workers.rows.continuation import Progress


def _request(rid: str, **sampling: object) -> RolloutRequest:
    return RolloutRequest.model_validate({"id": rid, "input_ids": [1, 2],
                                          "sampling_params": {"max_new_tokens": 8, **sampling}})


def _sample(ids: list[int], finished: bool = False) -> SampleOutput:
    finish = Finish("length") if finished else Finish("abort", message=INTERRUPTED)
    return SampleOutput(np.asarray(ids, np.int32), finish)


def test_tokens_are_published_once_across_a_continuation() -> None:
    requests = [_request("a"), _request("b")]
    turns = [TurnTag(turn_id="ta", session_id="s", turn=0, reply_to="srv", stream=True),
             TurnTag(turn_id="tb", session_id="s", turn=0, reply_to="srv")]
    streams = TurnStreams.of(requests, turns, attempt=3)
    assert streams is not None
    progress = Progress(requests)
    first = progress.first(0)
    assert not streams.started
    assert streams.deltas(progress.so_far((first, [[_sample([4, 5])], [_sample([9])]]))) == \
        [TokenDelta("ta", 3, 0, 0, [4, 5])]  # only the streamed turn
    assert streams.started  # its first tokens are out: later ones go at the slower pace
    progress.record(first, [[_sample([4, 5, 6])], [_sample([9, 9], finished=True)]])  # a partial swap stops it
    resumed = progress.resume(1)
    assert streams.deltas(progress.so_far((resumed, [[_sample([7])]]))) == [TokenDelta("ta", 3, 0, 2, [6, 7])]
    assert streams.deltas(progress.so_far((resumed, [[_sample([7])]]))) == []  # nothing new


def test_a_failed_publish_is_sent_again() -> None:
    requests = [_request("a")]
    tags = [TurnTag(turn_id="ta", session_id="s", turn=0, reply_to="srv", stream=True)]
    streams = TurnStreams.of(requests, tags, attempt=1)
    assert streams is not None
    progress = Progress(requests)
    first = progress.first(0)
    lost = streams.deltas(progress.so_far((first, [[_sample([4, 5])]])))
    streams.unpublish(lost)
    assert streams.deltas(progress.so_far((first, [[_sample([4, 5, 6])]]))) == [TokenDelta("ta", 1, 0, 0, [4, 5, 6])]


def test_samples_with_penalties_and_turns_not_streamed_get_no_streams() -> None:
    tag = TurnTag(turn_id="ta", session_id="s", turn=0, reply_to="srv", stream=True)
    assert TurnStreams.of([_request("a", repetition_penalty=1.1)], [tag], attempt=1) is None
    tags = [TurnTag(turn_id="ta", session_id="s", turn=0, reply_to="srv")]
    assert TurnStreams.of([_request("a")], tags, attempt=1) is None
    assert TurnStreams.of([_request("a")], None, attempt=1) is None
