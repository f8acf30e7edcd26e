"""The sglang-http engine against stand-in SGLang servers (separate processes, real HTTP)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.request import RolloutRequest
from tests.helpers import sampling_reference as ref
from tests.helpers.models import token_id
from tests.helpers.processes import free_port, wait_until
from tests.workers.engines.conftest import Standin
from workers.engines.base import SampleOutput
from workers.engines.hf.engine import HFEngine
from workers.engines.sglang.client import RetryPolicy
from workers.engines.sglang.expert_ids import ExpertsLayout
from workers.engines.sglang.http_engine import SGLangHTTPEngine
from workers.errors import ContractViolation, EngineUnavailableError, UnsupportedRequestError
from workers.rows.table import RowContext, build_table

FAST_RETRY = RetryPolicy(attempts=3, backoff_s=0.05, max_backoff_s=0.1, down_cooldown_s=0.2)


def ids(text: str) -> list[int]:
    return [token_id(c) for c in text]


def req(rid: str, prompt: str, **fields: Any) -> RolloutRequest:
    sampling = {"max_new_tokens": 8, "temperature": 0.0, **fields.pop("sampling", {})}
    return RolloutRequest.model_validate({"id": rid, "input_ids": ids(prompt), "sampling_params": sampling,
                                          **fields})


@pytest.fixture(scope="module")
def hf_scripted(scripted_model_dir: Path) -> HFEngine:
    return HFEngine(scripted_model_dir, max_top_logprobs=3)


@pytest.fixture
def engine(scripted_server: Standin) -> Iterator[SGLangHTTPEngine]:
    engine = SGLangHTTPEngine([scripted_server.url], max_top_logprobs=3, retry=FAST_RETRY)
    yield engine
    engine.close()


def table(requests: list[RolloutRequest], outputs: list[list[SampleOutput]], engine_name: str,  # type: ignore[no-untyped-def]
          weight_version: int = 0):
    now = datetime.now(UTC)
    ctx = RowContext(run="r", job_id="j", engine=engine_name, model="m", worker_id="w",
                     weight_version=weight_version, submitted_at=now, started_at=now, finished_at=now)
    return build_table(requests, outputs, ctx)


# The contract table over the scripted model (a→b→c→d, d→e|x, e→EOS, x↔y, !→! forever).
CASES = [
    req("eos", "ab"),                                                       # ...e, EOS
    req("token-stop", "ab", sampling={"stop": [token_id("d")]}),            # user token id
    req("stop-ids", "ab", sampling={"stop_token_ids": [token_id("e")]}),
    req("string-stop", "ab", sampling={"stop": ["cd"]}),
    req("literal", "ab", sampling={"stop": "token_id:4"}),                  # a literal string
    req("length", "!", sampling={"max_new_tokens": 5}),
    req("ignore-eos", "de", sampling={"ignore_eos": True, "max_new_tokens": 3, "stop": [0]}),
    req("no-trim", "ab", sampling={"stop": "c", "no_stop_trim": True}),
    req("top-k", "ab", logprobs=3),
    req("no-logprobs", "ab", logprobs=None),
    req("prompt-lp", "abc", prompt_logprobs=0),
    req("n-greedy", "ab", sampling={"n": 3}),
]


def test_same_outputs_and_rows_as_hf_direct(engine: SGLangHTTPEngine, hf_scripted: HFEngine) -> None:
    via_http = engine.generate(CASES)
    direct = hf_scripted.generate(CASES)
    http_rows = table(CASES, via_http, "sglang-http", engine.weight_version).to_pylist()
    hf_rows = table(CASES, direct, "hf").to_pylist()
    assert len(http_rows) == len(hf_rows) == sum(r.sampling_params.n for r in CASES)
    for got, want in zip(http_rows, hf_rows, strict=True):
        who = got["rollout_id"]
        for column in ("completion_token_ids", "finish_reason", "stop_reason_text", "stop_reason_token",
                       "completion_tokens"):
            assert got[column] == want[column], (who, column)
        for column in ("completion_logprobs", "prompt_logprobs"):
            assert (got[column] is None) == (want[column] is None), (who, column)
            if got[column] is not None:
                np.testing.assert_allclose(np.array(got[column], dtype=float),
                                           np.array(want[column], dtype=float), atol=1e-5)
        if got["completion_top_logprobs"] is not None:
            for ours, theirs in zip(got["completion_top_logprobs"], want["completion_top_logprobs"], strict=True):
                np.testing.assert_allclose([e["logprob"] for e in ours], [e["logprob"] for e in theirs], atol=1e-5)
                assert untied(ours) == untied(theirs), who  # tied alternatives may come in any order
        else:
            assert want["completion_top_logprobs"] is None
        # Both follow SGLang's detokenizer trim_matched_stop (stop string and stop token text).
        assert got["completion_text"] == want["completion_text"], who
        assert got["engine"] == "sglang-http"


def untied(top: list[dict]) -> list[int]:
    """The token ids of top-logprob entries that no other token ties with (the last shown entry
    may tie with tokens not shown, so entries at its value are left out too)."""
    values = [e["logprob"] for e in top]
    return [e["token_id"] for e in top
            if sum(abs(e["logprob"] - v) < 1e-6 for v in values) == 1 and e["logprob"] > values[-1] + 1e-6]


def test_stop_rows_are_what_the_contract_says(engine: SGLangHTTPEngine) -> None:
    outputs = engine.generate(CASES)
    rows = {r["rollout_id"]: r for r in table(CASES, outputs, "sglang-http", engine.weight_version).to_pylist()}
    assert rows["eos:0"]["completion_token_ids"] == [*ids("cde"), 0]
    assert (rows["eos:0"]["finish_reason"], rows["eos:0"]["stop_reason_token"]) == ("stop", None)
    assert rows["token-stop:0"]["stop_reason_token"] == token_id("d")
    assert rows["token-stop:0"]["completion_token_ids"] == ids("cd")     # the stop token is kept
    assert rows["token-stop:0"]["completion_text"] == "c"                # its text is not (SGLang)
    assert rows["stop-ids:0"]["stop_reason_token"] == token_id("e")
    assert rows["string-stop:0"]["stop_reason_text"] == "cd"
    assert rows["string-stop:0"]["completion_text"] == ""
    assert rows["string-stop:0"]["completion_token_ids"] == ids("cd")
    assert rows["literal:0"]["finish_reason"] == "stop" and rows["literal:0"]["stop_reason_text"] is None
    assert rows["length:0"]["finish_reason"] == "length"
    assert rows["length:0"]["completion_token_ids"] == ids("!!!!!")
    assert rows["ignore-eos:0"]["finish_reason"] == "length"
    assert rows["no-trim:0"]["completion_text"] == "c"
    assert rows["prompt-lp:0"]["prompt_logprobs"][0] is None
    assert len(rows["prompt-lp:0"]["prompt_logprobs"]) == 3
    assert [len(p) for p in rows["top-k:0"]["completion_top_logprobs"]] == [3] * 4
    assert rows["no-logprobs:0"]["completion_logprobs"] is None
    assert {rows[f"n-greedy:{i}"]["completion_token_ids"] == rows["eos:0"]["completion_token_ids"]
            for i in range(3)} == {True}


def test_n_greater_than_one_samples_differ_and_each_has_its_own_finish(tiny_server: Standin) -> None:
    engine = SGLangHTTPEngine([tiny_server.url], retry=FAST_RETRY)
    try:
        sampled = req("n", "hello", sampling={"n": 4, "temperature": 1.0, "max_new_tokens": 6})
        seeded = req("ns", "hello", sampling={"n": 4, "temperature": 1.0, "max_new_tokens": 6, "seed": 11})
        before = tiny_server.stats()["generate"]
        [unseeded, with_seed] = engine.generate([sampled, seeded])
        assert tiny_server.stats()["generate"] - before == 1 + 4   # one n=4 call, four seeded calls
        for samples in (unseeded, with_seed):
            assert len(samples) == 4
            assert len({tuple(s.token_ids.tolist()) for s in samples}) > 1, "n samples are all identical"
            assert all(len(s.logprobs) == len(s.token_ids) for s in samples)
        again = engine.generate([seeded])[0]
        assert [s.token_ids.tolist() for s in again] == [s.token_ids.tolist() for s in with_seed]
    finally:
        engine.close()


def test_seeded_sampling_is_reproducible_and_follows_sglangs_rules(tiny_server: Standin, tiny_model_dir: Path) -> None:
    """The stand-in draws with its own generator, so tokens are not hf's; what holds for any
    SGLang server: a seed reproduces its samples, another seed gives others, and every token and
    stored logprob follows SGLang's rules over the model's own logits."""
    def run(seed: int) -> SampleOutput:
        request = req("s", "abc", sampling={"temperature": 0.8, "top_p": 0.9, "seed": seed, "max_new_tokens": 10,
                                             "ignore_eos": True})
        engine = SGLangHTTPEngine([tiny_server.url])
        try:
            return engine.generate([request])[0][0]
        finally:
            engine.close()

    first = run(5)
    assert run(5).token_ids.tolist() == first.token_ids.tolist()
    assert run(6).token_ids.tolist() != first.token_ids.tolist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = first.token_ids.tolist()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids("abc") + tokens])).logits[0].double().numpy()
    rule = ref.Rule(temperature=0.8, top_p=0.9)
    for step, token in enumerate(tokens):
        scores = logits[len("abc") - 1 + step]
        assert token in ref.allowed(scores, rule, slack=1e-5)
        assert float(first.logprobs[step]) == pytest.approx(ref.logprobs(scores, rule)[token], abs=1e-5)


# -- faults ------------------------------------------------------------------------------------


def test_server_down_at_start_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineUnavailableError, match=f"{url}: cannot connect .*is the server running"):
        SGLangHTTPEngine([url], connect_timeout_s=2)


def test_a_server_older_than_sglang_0_5_is_read_through_get_model_info(
    scripted_model_dir: Path, tmp_path: Path
) -> None:
    from tests.workers.engines.conftest import launch, stop, wait_ready

    old = launch(scripted_model_dir, tmp_path / "old.log", "--only-get-info")
    try:
        wait_ready(old)
        assert httpx.get(f"{old.url}/model_info", timeout=5).status_code == 404
        engine = SGLangHTTPEngine([old.url])
        try:
            assert engine.description.model == str(scripted_model_dir)
            assert engine.model_info()[old.url]["model_path"] == str(scripted_model_dir)
        finally:
            engine.close()
    finally:
        stop(old)


def test_503_then_success_is_retried(engine: SGLangHTTPEngine, scripted_server: Standin) -> None:
    scripted_server.faults(status_503=2)
    before = scripted_server.stats()
    [[sample]] = engine.generate([req("x", "ab")])
    after = scripted_server.stats()
    assert sample.token_ids.tolist() == [*ids("cde"), 0]
    assert after["http_generate"] - before["http_generate"] == 3
    assert after["faults"][-2:] == ["503", "503"]
    assert after["rids"][-1].endswith("-r2"), "each attempt carries a fresh rid"


def test_dropped_connection_is_retried(engine: SGLangHTTPEngine, scripted_server: Standin) -> None:
    scripted_server.faults(drop=1)
    before = scripted_server.stats()["http_generate"]
    [[sample]] = engine.generate([req("x", "ab")])
    assert sample.finish.kind == "stop"
    assert scripted_server.stats()["http_generate"] - before == 2


def test_503_every_time_gives_up_with_the_reason(engine: SGLangHTTPEngine, scripted_server: Standin) -> None:
    scripted_server.faults(status_503=10)
    with pytest.raises(EngineUnavailableError, match=r"after 3 attempts; last error: .*HTTP 503"):
        engine.generate([req("x", "ab")])


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("truncated", "body that is not JSON"),
        ("no_meta", "not an object with meta_info"),
        ("unknown_finish", "unknown finish_reason type 'exploded'"),
        ("short_logprobs", "output_token_logprobs for"),
    ],
)
def test_malformed_answers_fail_the_whole_batch(
    engine: SGLangHTTPEngine, scripted_server: Standin, fault: str, error: str
) -> None:
    scripted_server.faults(**{fault: 1})
    before = scripted_server.stats()["http_generate"]
    with pytest.raises(ContractViolation, match=error):
        engine.generate([req("bad", "ab"), req("good", "h")])
    assert scripted_server.stats()["http_generate"] - before <= 2   # not retried


def test_4xx_is_not_retried(engine: SGLangHTTPEngine, scripted_server: Standin) -> None:
    before = scripted_server.stats()["http_generate"]
    bad = RolloutRequest(id="oov", input_ids=[1000])             # outside the 72-token vocabulary
    with pytest.raises(UnsupportedRequestError, match="HTTP 400: input_ids has token id 1000"):
        engine.generate([bad])
    assert scripted_server.stats()["http_generate"] - before == 1


def test_a_failure_cancels_the_rest_of_the_batch_and_aborts_it(
    engine: SGLangHTTPEngine, scripted_server: Standin
) -> None:
    scripted_server.faults(delays={"slow": 5.0, "bad": 0.5}, fault_prefix="bad", unknown_finish=1)
    before = scripted_server.stats()
    with pytest.raises(ContractViolation, match="unknown finish_reason type"):
        engine.generate([req("slow", "ab"), req("bad", "ab")])
    after = scripted_server.stats()
    aborted = [a["rid"] for a in after["abort_requests"][len(before["abort_requests"]):]]
    assert len(aborted) == 1 and aborted[0].startswith("slow-")
    assert aborted == engine.client.aborted[-1:]
    # The server saw the abort and dropped the request instead of generating it.
    wait_until(lambda: scripted_server.stats()["answered"] - before["answered"] >= 2, 30, "both calls answered")
    assert scripted_server.stats()["answered_aborted"] - before["answered_aborted"] == 1


def test_sglang_validation_errors_come_back_verbatim(engine: SGLangHTTPEngine, scripted_server: Standin) -> None:
    response = httpx.post(f"{scripted_server.url}/generate",
                          json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    assert response.status_code == 400 and response.json()["error"].startswith("unknown field `max_tokens`")
    response = httpx.post(f"{scripted_server.url}/generate", json={"input_ids": []})
    assert response.status_code == 400 and response.json() == {"error": {"message": "input_ids cannot be empty."}}
    # FastAPI's parse of GenerateReqInput refuses it before the contract gate: 422.
    response = httpx.post(f"{scripted_server.url}/generate", json={"input_ids": [1, "2"]})
    assert response.status_code == 422 and "non-int64 element" in response.json()["detail"][0]["msg"]
    response = httpx.post(f"{scripted_server.url}/generate", json={"input_ids": [1], "return_logprob": "yes"})
    assert response.json() == {"error": 'invalid type: string "yes", expected a value or an array of values for '
                                        "BoolOrList"}


# -- several servers ---------------------------------------------------------------------------


def pause(server: Standin) -> None:
    httpx.post(f"{server.url}/pause_generation", json={"mode": "in_place"}, timeout=5).raise_for_status()


def resume(server: Standin) -> None:
    httpx.post(f"{server.url}/continue_generation", timeout=5).raise_for_status()


def in_background(engine: SGLangHTTPEngine, batch: list[RolloutRequest]) -> tuple[threading.Thread, list]:
    outputs: list = []
    thread = threading.Thread(target=lambda: outputs.extend(engine.generate(batch)), daemon=True)
    thread.start()
    return thread, outputs


def test_two_urls_spread_the_batch_by_least_in_flight(standins: dict[str, Standin]) -> None:
    """Both servers hold what they get (paused in place), so every request is placed while the
    others are still in flight: least-in-flight alternates them exactly."""
    a, b = standins["scripted"], standins["scripted_b"]
    engine = SGLangHTTPEngine([a.url, b.url], max_in_flight=10)
    before = (a.stats()["generate"], b.stats()["generate"])
    for server in (a, b):
        pause(server)
    try:
        thread, outputs = in_background(engine, [req(f"r{i}", "ab") for i in range(10)])
        wait_until(lambda: a.stats()["in_flight"] + b.stats()["in_flight"] == 10, 30, "all ten requests placed")
    finally:
        for server in (a, b):
            resume(server)
    thread.join(60)
    engine.close()
    assert all(o[0].token_ids.tolist() == [*ids("cde"), 0] for o in outputs) and len(outputs) == 10
    served = (a.stats()["generate"] - before[0], b.stats()["generate"] - before[1])
    assert served == (5, 5)
    assert engine.client.pool.sent == {a.url: 5, b.url: 5}


def test_max_in_flight_bounds_the_calls_and_out_of_order_answers_reach_their_requests(
    scripted_server: Standin,
) -> None:
    """Ten distinct prompts through max_in_flight=3: the server never holds more than three (and
    holds three while paused); delays make later calls answer first, and each answer still
    lands on its own request."""
    prompts = ["ab", "bc", "h", "xy", "yx", "!", "abc", "x", "y", "b"]
    batch = [req(f"p{i}", prompt, sampling={"max_new_tokens": 6}) for i, prompt in enumerate(prompts)]
    # Earlier calls wait longer, so later ones overtake them.
    scripted_server.faults(delays={f"p{i}-": 0.05 * (len(prompts) - i) for i in range(len(prompts))},
                           reset_max_in_flight=True)
    engine = SGLangHTTPEngine([scripted_server.url], max_in_flight=3)
    start = scripted_server.stats()
    pause(scripted_server)
    try:
        thread, outputs = in_background(engine, batch)
        wait_until(lambda: scripted_server.stats()["in_flight"] == 3, 30, "three calls held by the server")
    finally:
        resume(scripted_server)
    thread.join(60)
    engine.close()
    stats = scripted_server.stats()
    assert stats["max_in_flight"] == 3
    assert stats["generate"] - start["generate"] == len(prompts)
    order = [rid.split("-")[0] for rid in stats["answer_order"][len(start["answer_order"]):]]
    assert sorted(order) == sorted(f"p{i}" for i in range(len(prompts)))
    assert order != [f"p{i}" for i in range(len(prompts))], "the delays should have reordered the answers"
    alone = SGLangHTTPEngine([scripted_server.url])
    try:
        one_by_one = [alone.generate([request])[0][0].token_ids.tolist() for request in batch]
    finally:
        alone.close()
    assert [samples[0].token_ids.tolist() for samples in outputs] == one_by_one
    assert len({tuple(tokens) for tokens in one_by_one}) >= 6  # distinct answers, so a mix-up shows


def test_a_url_that_goes_down_is_avoided(standins: dict[str, Standin], tmp_path: Path) -> None:
    from tests.workers.engines.conftest import launch, stop, wait_ready

    doomed = launch(standins["scripted"].model_dir, tmp_path / "doomed.log")
    wait_ready(doomed)
    live = standins["scripted_b"]
    engine = SGLangHTTPEngine([doomed.url, live.url], retry=FAST_RETRY)
    try:
        stop(doomed)
        outputs = engine.generate([req(f"r{i}", "ab") for i in range(4)])
        assert all(o[0].finish.kind == "stop" for o in outputs)
    finally:
        engine.close()


# -- lifecycle ---------------------------------------------------------------------------------


def test_weight_update_pause_continue_flush_and_health(standins: dict[str, Standin]) -> None:
    a, b = standins["scripted"], standins["scripted_b"]
    engine = SGLangHTTPEngine([a.url, b.url])
    try:
        engine.health()
        version = engine.weight_version + 7
        engine.update_weights(str(a.model_dir), version)
        assert engine.weight_version == version
        assert {info["weight_version"] for info in engine.model_info().values()} == {str(version)}
        samples = [o[0] for o in engine.generate([req(f"w{i}", "ab") for i in range(4)])]
        assert {s.weight_version for s in samples} == {version}

        failed_on_both = f"{a.url}: HTTP 400: Failed to get weights.*; {b.url}: HTTP 400"
        with pytest.raises(EngineUnavailableError, match=failed_on_both):
            engine.update_weights("/nonexistent/model", version + 1)
        assert engine.weight_version == version

        engine.pause_generation("in_place")
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(engine.generate([req("p", "ab")])))
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "generation ran while paused"
        engine.continue_generation()
        thread.join(10)
        assert result and result[0][0][0].finish.kind == "stop"
        engine.flush_cache()
        with pytest.raises(ValueError, match="pause mode"):
            engine.pause_generation("later")
    finally:
        engine.continue_generation()
        engine.close()


def test_engine_picks_up_the_servers_weight_version_and_describes_itself(scripted_server: Standin) -> None:
    engine = SGLangHTTPEngine([scripted_server.url], max_top_logprobs=2)
    try:
        served = engine.model_info()[scripted_server.url]["weight_version"]
        assert engine.weight_version == (int(served) if served.isdigit() else 0)
        d = engine.description
        assert (d.name, d.model, d.capabilities.max_top_logprobs) == ("sglang-http", str(scripted_server.model_dir), 2)
        assert d.capabilities.routed_experts is False
    finally:
        engine.close()


def test_routed_experts(scripted_server: Standin) -> None:
    with pytest.raises(EngineUnavailableError, match="expert layout"):
        SGLangHTTPEngine([scripted_server.url], routed_experts=True)
    engine = SGLangHTTPEngine([scripted_server.url], routed_experts=True,
                              experts_layout=ExpertsLayout(layers=2, top_k=2, num_experts=8))
    try:
        request = req("moe", "ab", return_routed_experts=True)
        [[sample]] = engine.generate([request])
        assert sample.routed_experts is not None
        assert sample.routed_experts.shape == (2 + len(sample.token_ids) - 1, 2, 2)
        assert engine.description.num_experts == 8
        row = table([request], [[sample]], "sglang-http", engine.weight_version).to_pylist()[0]
        assert row["routed_experts_shape"] == list(sample.routed_experts.shape)
        # Stored as each (position, layer)'s ids ascending, whatever order the server sent.
        stored = np.asarray(row["routed_experts"]).reshape(row["routed_experts_shape"])
        np.testing.assert_array_equal(stored, np.sort(sample.routed_experts, axis=-1))
    finally:
        engine.close()


def test_worker_cli_builds_the_engine_from_repeated_urls(standins: dict[str, Standin]) -> None:
    import argparse

    from workers.commands.worker_options import add_engine_arguments, engine_options
    from workers.engines.factory import build_engine

    a, b = standins["scripted"], standins["scripted_b"]
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    options = engine_options(parser.parse_args(["--engine", "sglang-http", "--url", a.url, "--url", b.url]))
    assert options.urls == (a.url, b.url)
    engine = build_engine(options)
    try:
        assert isinstance(engine, SGLangHTTPEngine) and engine.urls == [a.url, b.url]
    finally:
        engine.close()


def test_a_streamed_batch_reports_its_tokens_as_the_server_streams_them(engine: SGLangHTTPEngine,
                                                                         scripted_server: Standin) -> None:
    """`submit_streamed` (a streamed agent turn): the call is streamed, `progress` has the tokens the
    server sent while it holds the rest, and the answer is the one a plain call gets."""
    request = req("s", "xy", logprobs=2, sampling={"max_new_tokens": 12})
    plain = engine.generate([request])
    assert len(plain[0][0].token_ids) > 3
    scripted_server.faults(hold_streams_after=3)
    try:
        future = engine.submit_streamed([request])
        wait_until(lambda: (so_far := engine.progress(future)) is not None and len(so_far[0][0].token_ids) == 3,
                   timeout=30, what="three streamed tokens")
        assert not future.done()
        (sample,) = engine.progress(future)[0]  # type: ignore[index]
        assert sample.finish.interrupted and sample.token_ids.tolist() == plain[0][0].token_ids[:3].tolist()
    finally:
        scripted_server.faults(release_streams=True, hold_streams_after=None)
    (streamed,) = future.result(timeout=60)[0]
    assert streamed.token_ids.tolist() == plain[0][0].token_ids.tolist()
    assert streamed.logprobs.tolist() == plain[0][0].logprobs.tolist()  # type: ignore[union-attr]
    assert streamed.finish == plain[0][0].finish and streamed.text == plain[0][0].text
    assert engine.progress(future) is None  # resolved
