"""Continuing samples across partial swaps: continuation requests, merged segments, and the
contracts held over the whole completion (straddling stops, budgets, penalties, seeds, routing)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from schemas.request import RolloutRequest
from tests.helpers.models import CHARS, token_id
from workers.engines.base import INTERRUPTED, ContinuedRequest, Finish, SampleOutput
from workers.engines.seeds import continuation_seed, request_sample_seed, sample_seed
from workers.engines.sim.engine import SimConfig, SimEngine
from workers.errors import ContractViolation
from workers.rows.continuation import Progress, merge, straddling_stop


def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
    return "".join(CHARS[i - 1] for i in ids if i)


def ids(text: str) -> np.ndarray:
    return np.array([token_id(c) for c in text], dtype=np.int32)


def out(text: str, finish: Finish, version: int, **fields: object) -> SampleOutput:
    tokens = ids(text)
    return SampleOutput(token_ids=tokens, finish=finish, logprobs=np.full(len(tokens), -0.1 * (version + 1),
                        dtype=np.float32), weight_version=version, text=decode(tokens.tolist(), True),
                        **fields)  # type: ignore[arg-type]


STOPPED = Finish("abort", message=INTERRUPTED)


def request(**params: object) -> RolloutRequest:
    return RolloutRequest(id="r", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 20, **params})


def test_continuation_request_carries_prompt_generated_ids_and_what_remains() -> None:
    original = request(min_new_tokens=8, n=3, seed=7, stop="\n\n")
    progress = Progress([original])
    first = progress.first(0)
    parts = [[out("ab", STOPPED, 0), out("abcdef", Finish("length"), 0), out("abcdefghij", STOPPED, 0)]]
    progress.record(first, parts)
    assert not progress.done
    resumed = progress.resume(1)
    assert [s for slots in resumed.slots for s in slots] == [(0, 0), (0, 2)]
    a, c = resumed.requests
    assert isinstance(a, ContinuedRequest) and isinstance(c, ContinuedRequest)
    assert a.input_ids == [1, 2, 3, *ids("ab").tolist()] and a.generated == 2 and a.sample_index == 0
    assert a.sampling_params.max_new_tokens == 18 and a.sampling_params.min_new_tokens == 6
    assert c.sampling_params.max_new_tokens == 10 and c.sampling_params.min_new_tokens == 0
    assert c.sample_index == 2 and c.sampling_params.n == 1 and c.sampling_params.stop == "\n\n"
    assert c.prompt_logprobs is None and c.prompt_length == 3


def test_seeds_keep_sample_identity_across_continuations() -> None:
    original = request(n=2, seed=11)
    progress = Progress([original])
    progress.record(progress.first(0), [[out("ab", STOPPED, 0), out("ab", STOPPED, 0)]])
    first, second = progress.resume(1).requests
    assert request_sample_seed(first, 0) == continuation_seed(11, 0, 2)
    assert request_sample_seed(second, 0) == continuation_seed(11, 1, 2)
    seeds = {continuation_seed(11, 0, 2), continuation_seed(11, 1, 2), sample_seed(11, 0), sample_seed(11, 1),
             continuation_seed(11, 0, 3)}
    assert len(seeds) == 5  # distinct per sample, per offset, and from the samples' own starts


def test_merged_sample_has_per_token_versions_and_logprobs_of_each_segment() -> None:
    original = request()
    progress = Progress([original])
    progress.record(progress.first(0), [[out("abc", STOPPED, 0)]])
    resumed = progress.resume(1)
    progress.record(resumed, [[out("defg", Finish("stop", matched=token_id("g")), 1)]])
    assert progress.done and progress.continued == 1 and progress.restarted == 0
    (merged,), = progress.outputs(decode)
    assert merged.token_ids.tolist() == ids("abcdefg").tolist()
    assert merged.version_segments == [(0, 0), (3, 1)]
    assert merged.logprobs is not None and np.allclose(merged.logprobs, [-0.1] * 3 + [-0.2] * 4)
    # The text is decoded over the whole completion; a matched stop token's text dropped, as engines do.
    assert merged.text == "abcdef" and merged.finish == Finish("stop", matched=token_id("g"))


def test_a_sample_never_interrupted_is_the_engine_output_as_is() -> None:
    progress = Progress([request(n=2)])
    done = out("abc", Finish("length"), 0)
    progress.record(progress.first(0), [[done, out("ab", STOPPED, 0)]])
    progress.record(progress.resume(1), [[out("c", Finish("length"), 1)]])
    (first, second), = progress.outputs(decode)
    assert first is done and first.version_segments is None
    assert second.version_segments == [(0, 0), (2, 1)]


def test_stop_string_straddling_the_boundary_still_stops_and_trims() -> None:
    # The first segment ends in "\n"... here "x" stands for it: stop "xx"; the continuation begins with "x".
    original = request(stop="xx")
    tokens = ids("abx" + "xcd")
    assert straddling_stop(tokens, [3], original.sampling_params, decode) == (4, "xx")
    merged = merge(original, [(out("abx", STOPPED, 0), 0), (out("xcd", Finish("length"), 1), 1)], decode)
    assert merged.token_ids.tolist() == ids("abxx").tolist()
    assert merged.finish == Finish("stop", matched="xx")
    assert merged.version_segments == [(0, 0), (3, 1)] and merged.logprobs is not None and len(merged.logprobs) == 4
    assert merged.text == "abxx"  # the row trims the stop string from the text as usual


def test_a_stop_completed_before_min_new_tokens_does_not_stop() -> None:
    original = request(stop="xx", min_new_tokens=6)
    assert straddling_stop(ids("abx" + "xcd"), [3], original.sampling_params, decode) is None


def test_a_straddling_stop_cuts_routed_experts_of_the_last_segment() -> None:
    original = RolloutRequest(id="r", input_ids=[1, 2, 3], return_routed_experts=True,
                              sampling_params={"max_new_tokens": 20, "stop": "xx"})
    # The continuation's prefill re-routed every position: prompt 3 + "abx" 3 + "xcd" 3 - 1 = 8 rows.
    routing = np.arange(8 * 2 * 2, dtype=np.int32).reshape(8, 2, 2)
    merged = merge(original, [(out("abx", STOPPED, 0, routed_experts=np.zeros((5, 2, 2), np.int32)), 0),
                              (out("xcd", Finish("length"), 1, routed_experts=routing), 1)], decode)
    assert merged.routed_experts is not None and merged.routed_experts.shape == (3 + 4 - 1, 2, 2)
    assert np.array_equal(merged.routed_experts, routing[:6])  # the last segment's routing, cut to the stop


def test_penalised_samples_restart_from_scratch_instead_of_continuing() -> None:
    original = request(frequency_penalty=0.5, n=2, seed=3)
    progress = Progress([original])
    progress.record(progress.first(0), [[out("abc", STOPPED, 0), out("", STOPPED, 0)]])
    assert progress.restarted == 1  # the one that had tokens; the waiting one had none to drop
    again = progress.resume(1)
    assert [r.input_ids for r in again.requests] == [[1, 2, 3], [1, 2, 3]]
    assert [r.sampling_params.max_new_tokens for r in again.requests] == [20, 20]
    progress.record(again, [[out("defg", Finish("length"), 1)], [out("hi", Finish("length"), 1)]])
    (first, second), = progress.outputs(decode)
    assert first.token_ids.tolist() == ids("defg").tolist() and first.version_segments == [(0, 1)]
    assert second.version_segments == [(0, 1)]


def test_a_sample_back_twice_or_too_many_outputs_is_a_violation() -> None:
    progress = Progress([request()])
    first = progress.first(0)
    progress.record(first, [[out("ab", Finish("length"), 0)]])
    with pytest.raises(ContractViolation, match="came back twice"):
        progress.record(first, [[out("ab", Finish("length"), 0)]])
    with pytest.raises(ContractViolation, match="2 outputs for 1 requests"):
        Progress([request()]).record(first, [[], []])


def test_sim_interrupt_keeps_generated_tokens_and_continues_the_plan() -> None:
    config = SimConfig(step_s=0.002, median_tokens=10_000, p99_tokens=10_001, capacity=1)
    engine = SimEngine(config)
    try:
        running = RolloutRequest(id="a", input_ids=[1, 2], sampling_params={"max_new_tokens": 400, "seed": 1})
        waiting = RolloutRequest(id="b", input_ids=[1, 2], sampling_params={"max_new_tokens": 5, "seed": 2})
        first = engine.submit([running])
        second = engine.submit([waiting])  # no free slot: waits
        # 20 steps after the submit (the steps an idle engine counted before it, on a loaded machine, no)
        submitted_at = engine.stats().steps
        while engine.stats().steps < submitted_at + 20:
            pass
        assert engine.interrupt() == 2
        (a,), = first.result(timeout=1)
        (b,), = second.result(timeout=1)
        assert a.finish.interrupted and b.finish.interrupted and len(b.token_ids) == 0
        assert 20 <= len(a.token_ids) < 400 and engine.load() == 0
        engine.update_weights("/v1", 1)
        progress = Progress([running])
        progress.record(progress.first(0), [[a]])
        resumed = progress.resume(1)
        progress.record(resumed, engine.submit(resumed.requests).result(timeout=5))
        (merged,), = progress.outputs(engine.decode)
        plan = SimEngine(SimConfig(median_tokens=10_000, p99_tokens=10_001)).generate([running])[0][0]
        assert merged.token_ids.tolist() == plan.token_ids.tolist()
        assert merged.version_segments == [(0, 0), (len(a.token_ids), 1)]
    finally:
        engine.close()


def test_staleness_bound_restarts_a_sample_too_far_behind_instead_of_continuing_it() -> None:
    for bound, expected_inputs in ((0, [1, 2, 3]), (1, [1, 2, 3, *ids("abc").tolist()])):
        progress = Progress([request()], max_staleness=bound)
        progress.record(progress.first(0), [[out("abc", STOPPED, 0)]])
        (resumed,) = progress.resume(1).requests
        assert resumed.input_ids == expected_inputs
        assert progress.restarted == (1 if bound == 0 else 0)


def test_staleness_bound_at_commit_restarts_finished_samples_that_fell_behind() -> None:
    progress = Progress([request(n=2)], max_staleness=1)
    progress.record(progress.first(0), [[out("ab", Finish("length"), 0), out("cd", STOPPED, 0)]])
    progress.record(progress.resume(1), [[out("e", Finish("length"), 1)]])
    assert progress.done
    assert progress.stale(1) == 0  # one version behind: within the bound
    assert progress.stale(2) == 2 and not progress.done and progress.restarted == 2
    again = progress.resume(2)
    assert [r.input_ids for r in again.requests] == [[1, 2, 3], [1, 2, 3]]  # from the start, both
    progress.record(again, [[out("xy", Finish("length"), 2)], [out("zz", Finish("length"), 2)]])
    assert progress.stale(2) == 0
    (first, second), = progress.outputs(decode)
    assert first.version_segments == [(0, 2)] and second.version_segments == [(0, 2)]


def test_a_sample_repinned_to_a_new_adapter_version_keeps_each_tokens_adapter_version() -> None:
    """A partial adapter push re-pins the job (`Feeder.repin_adapter`): the continuation names the new
    version, the merged sample has adapter segments, a sample stopped before its first token is all
    the new version's, and the checkpoint's pieces carry the versions back through a restore."""
    from workers.jobs.adapters import repin
    from workers.jobs.checkpoint import chains, encode

    original = RolloutRequest(id="r", input_ids=[1, 2, 3], adapter="sql", sampling_params={"max_new_tokens": 8, "n": 2})
    original = repin([original], {"sql": 1})[0]  # as the worker pins it at admission
    progress = Progress([original])
    progress.record(progress.first(0), [[out("abc", STOPPED, 0), out("", STOPPED, 0)]])
    progress.requests = repin(progress.requests, {"sql": 2})
    resumed = progress.resume(0)
    assert [r.adapter for r in resumed.requests] == ["sql@v2", "sql@v2"]
    pieces = progress.unsaved()
    assert [(p.slot, p.adapter_version) for p in pieces] == [((0, 0), 1)]
    progress.mark_saved(pieces)
    progress.record(resumed, [[out("defgh", Finish("length"), 0)], [out("abcdefgh", Finish("length"), 0)]])
    first, second = progress.outputs(decode)[0]
    assert first.adapter_version_segments == [(0, 1), (3, 2)] and first.version_segments == [(0, 0)]
    assert second.adapter_version_segments == [(0, 2)]  # stopped before its first token: all v2's
    # The worker dies after saving; the next one restores the pieces with their adapter versions.
    pieces += progress.unsaved()
    restored = Progress(repin([original], {"sql": 2}))
    assert restored.restore(chains([encode(p, 7) for p in pieces], "j")) == 2
    again_first, again_second = restored.outputs(decode)[0]
    assert again_first.adapter_version_segments == [(0, 1), (3, 2)]
    assert again_first.token_ids.tolist() == ids("abcdefgh").tolist()
    assert again_second.adapter_version_segments == [(0, 2)]
