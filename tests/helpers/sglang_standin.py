"""A stand-in SGLang server for tests: real HTTP, SGLang 0.5.x shapes, its own generator.

Nothing of the code under test answers: requests are judged by SGLang's own classes loaded from
its wheel (`tests.helpers.sglang_wheel`: FastAPI's `GenerateReqInput` parse, the `api_types` contract
gate, `normalize_batch_and_arguments`, `SamplingParams.normalize/verify`), and tokens come from
`tests.helpers.standin_generator` (plain transformers forward passes and SGLang's sampling rules), not
from the project's engines.

Run: `python -m tests.helpers.sglang_standin --model DIR --port P [--weight-version V]
[--routed-experts LAYERS,TOP_K,NUM_EXPERTS] [--only-get-info] [--enable-lora]`.

Each shape follows SGLang 0.5.23 (PyPI wheel), python/sglang/...:
- `POST /generate` request: judged by SGLang's code itself (above); its error bodies are
  SGLang's (422 `{"detail"}`, 400 `{"error": "<contract text>"}`, 400 `{"error": {"message"}}`).
- `/generate` response: `srt/managers/tokenizer_manager.py` (`text`, `output_ids`, `meta_info`
  with `id`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens`,
  `weight_version`, `e2e_latency`, logprob triples `[logprob, token_id, null]`,
  `output_top_logprobs`, `input_token_logprobs` with a null first logprob, base64 int32
  `routed_experts`); a list of results for n > 1. Finish shapes: `srt/managers/schedule_batch.py`
  (`FINISH_MATCHED_TOKEN`, `FINISH_MATCHED_STR`, `FINISH_LENGTH`, `FINISH_ABORT`). Text trimming:
  `srt/managers/detokenizer_manager.py: trim_matched_stop` (cut before a matched string, drop a
  matched stop token's text, unless `no_stop_trim`).
- Lifecycle: `srt/entrypoints/http_server.py` (`/health`, `/health_generate`, `/model_info` and
  its deprecated alias `/get_model_info`, `/server_info` and `/get_server_info`,
  `/update_weights_from_disk` → `{"success", "message", "num_paused_requests"}`
  200/400, `/pause_generation`, `/continue_generation`, `/flush_cache`, `/abort_request`).
- Routed experts (`--routed-experts L,K,E`, like `--enable-return-routed-experts`): rows =
  prompt + completion − 1 − start (`scheduler_components/batch_result_processor.py`); the ids
  are synthetic (a function of position, layer and slot), since the test models are dense.
- `--only-get-info`: only `/get_model_info` and `/get_server_info`, as SGLang 0.4.6 serves them.
- `GET /workers` answers 404, as on an SGLang server (gateways serve it).
- LoRA (`--enable-lora`): `/load_lora_adapter`, `/unload_lora_adapter` and `/generate`'s
  `lora_path`, as `tests.helpers.sglang_standin_lora` describes.

Stand-in choices, not SGLang's: generation is serialised (one request at a time, continuous
batching is not simulated; `delays` let answers overtake each other); unknown top-level fields
answer 400 (SGLang ignores them); prompt ids outside the vocabulary answer 400 (SGLang clamps);
`text` prompts and batched `input_ids` answer 400; `cached_tokens` is the longest prefix shared
with an earlier prompt (a crude radix cache). `stream: true` (single-sample calls only; n > 1
answers 400) sends SGLang's default cumulative chunks (`output_ids` so far, `text` null; the last
one the whole answer, as non-streamed) over a sample generated whole beforehand, then `[DONE]`.

Test hooks (not SGLang): `POST /_standin/faults {"kind": count}` makes the next /generate
calls fail: `503`, `drop` (close the connection without answering), `truncated` (a cut JSON
body), `no_meta`, `unknown_finish`, `short_logprobs` (only rids starting with `fault_prefix`,
when given); `{"delay_s": x}` delays each generation, `{"delays": {"rid-prefix": x}}` (replacing
earlier ones) some; `{"reset_max_in_flight": true}` restarts the peak count;
`{"hold_streams_after": k}` holds every streamed answer after its chunk of k tokens (after the
last chunk, before `[DONE]`, when it has k; aborts are not seen there) until
`{"release_streams": true}` (or a minute).
`GET /_standin/stats` returns counters (`http_generate`: /generate calls
received; `generate`: those that passed validation; `answered`, `answered_aborted`; `in_flight`
and its peak `max_in_flight`: admitted calls not yet answered), received rids, `answer_order`
(rids as answered), `/abort_request` bodies, `lifecycle`: every lifecycle call received,
`[method, path, body]` in order, and `loras`: the adapters loaded now, name -> path.
`{"forget_loras": true}` forgets every adapter, as a restart does.
"""

from __future__ import annotations

import argparse
import base64
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.sglang_standin_lora import LoraError, Loras
from tests.helpers.sglang_wheel import judge_generate, request_adapter
from tests.helpers.sglang_wheel import load as load_sglang
from tests.helpers.standin_generator import Generator, Sample

LIFECYCLE_PATHS = ("/update_weights_from_disk", "/pause_generation", "/continue_generation", "/flush_cache",
                   "/abort_request", "/load_lora_adapter", "/unload_lora_adapter")
FAULT_KINDS = ("503", "drop", "truncated", "no_meta", "unknown_finish", "short_logprobs")


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def _value_error(message: str) -> ApiError:
    return ApiError(400, {"error": {"message": message}})


@dataclass(frozen=True)
class Call:
    """An admitted `/generate` body: what SGLang made of it (one SamplingParams per sample)."""

    ids: list[int]
    rids: list[str]
    sampling: list[Any]
    top_logprobs: int
    prompt_logprobs: bool
    context: list[int]  # put before the prompt by the call's LoRA adapter (`sglang_standin_lora`)


class Standin:
    """The server's state: the engine, the weight version, pause, aborts, faults, counters."""

    def __init__(self, model: Path, *, weight_version: str = "default",
                 routed_experts: tuple[int, int, int] | None = None, only_get_info: bool = False,
                 enable_lora: bool = False) -> None:
        self.model_path = str(model)
        self.generator = Generator(model)
        self.loras = Loras(enable_lora, self.generator.vocab_size)
        request_adapter()  # SGLang's classes loaded before the first request, not during it
        self.weight_version = weight_version
        self.routed_experts = routed_experts
        self.info_paths = ("/get_model_info",) if only_get_info else ("/model_info", "/get_model_info")
        self.server_info_paths = ("/get_server_info",) if only_get_info else ("/server_info", "/get_server_info")
        self.generate_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.faults: dict[str, int] = {}
        self.fault_prefix = ""  # faults hit only rids starting with this
        self.delays: dict[str, float] = {}  # rid prefix -> seconds before generating
        self.aborted: set[str] = set()
        self.hold_streams_after: int | None = None
        self.streams_released = threading.Event()
        self.abort_generation = 0  # bumped by abort_all / pause(abort)
        self.seen_prompts: list[tuple[int, ...]] = []
        self.stats: dict[str, Any] = {"http_generate": 0, "generate": 0, "answered": 0, "answered_aborted": 0,
                                      "in_flight": 0, "max_in_flight": 0, "answer_order": [],
                                      "rids": [], "abort_requests": [], "faults": [],
                                      "lifecycle": []}

    def take_fault(self, rid: str) -> str | None:
        with self.state_lock:
            if not rid.startswith(self.fault_prefix):
                return None
            for kind in FAULT_KINDS:
                if self.faults.get(kind, 0) > 0:
                    self.faults[kind] -= 1
                    self.stats["faults"].append(kind)
                    return kind
        return None

    def set_faults(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.state_lock:
            if "delays" in body:
                self.delays = {k: float(v) for k, v in body.pop("delays").items()}
            if "delay_s" in body:
                self.delays[""] = float(body.pop("delay_s"))
            if body.pop("reset_max_in_flight", False):
                self.stats["max_in_flight"] = self.stats["in_flight"]
            if "hold_streams_after" in body:
                hold = body.pop("hold_streams_after")
                self.hold_streams_after = None if hold is None else int(hold)
                self.streams_released.clear()
            if body.pop("release_streams", False):
                self.streams_released.set()
            if body.pop("forget_loras", False):
                self.loras.forget()
            self.fault_prefix = str(body.pop("fault_prefix", self.fault_prefix))
            unknown = set(body) - set(FAULT_KINDS)
            if unknown:
                raise ApiError(400, {"error": f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}"})
            self.faults.update({k: int(v) for k, v in body.items()})
            return {"faults": self.faults, "delays": self.delays, "fault_prefix": self.fault_prefix}

    # -- /generate ---------------------------------------------------------------------------

    def to_call(self, body: Any) -> Call:
        """SGLang's own verdict on the body (`tests.helpers.sglang_wheel`), then what the stand-in does
        not serve."""
        verdict = judge_generate(body, self.generator.vocab_size, self.generator.tokenizer)
        if verdict.status != 200:
            raise ApiError(verdict.status, verdict.error)
        if body.get("stream") and len(verdict.rids) != 1:
            raise _value_error("the SGLang stand-in streams single-sample calls only")
        if body.get("text") is not None:
            raise _value_error("the SGLang stand-in serves input_ids prompts only")
        ids = body["input_ids"]
        if isinstance(ids[0], list):
            raise _value_error("the SGLang stand-in does not serve batched input_ids")
        vocab = self.generator.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise _value_error(f"input_ids has token id {bad[0]} outside the vocabulary [0, {vocab})")
        start = body.get("logprob_start_len")
        start = -1 if start is None else start
        if body.get("return_logprob") and start not in (-1, 0):
            raise _value_error("the SGLang stand-in serves logprob_start_len -1 or 0 only")
        if body.get("return_routed_experts") and self.routed_experts:
            start_len = body.get("routed_experts_start_len") or 0
            if not 0 <= start_len <= len(ids):
                raise _value_error(f"recv_req.routed_experts_start_len={start_len} is out of [0, {len(ids)}]")
        try:
            context = self.loras.context(body.get("lora_path"))
        except LoraError as exc:
            raise ApiError(exc.status, exc.body) from exc
        return Call(ids=list(ids), rids=list(verdict.rids), sampling=list(verdict.sampling),
                    top_logprobs=(body.get("top_logprobs_num") or 0) if body.get("return_logprob") else 0,
                    prompt_logprobs=bool(body.get("return_logprob")) and start == 0, context=context)

    def generate(self, body: Any) -> Any:
        call = self.to_call(body)
        rid = body.get("rid") or "standin"
        with self.state_lock:
            self.stats["generate"] += 1
            self.stats["rids"].append(rid)
            self.stats["in_flight"] += 1
            self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.stats["in_flight"])
            generation = self.abort_generation
        try:
            return self._generate(call, body, rid, generation)
        finally:
            with self.state_lock:
                self.stats["in_flight"] -= 1

    def _generate(self, call: Call, body: dict[str, Any], rid: str, generation: int) -> Any:
        tic = time.monotonic()
        self.running.wait()
        with self.state_lock:
            delay = max([s for prefix, s in self.delays.items() if rid.startswith(prefix)], default=0.0)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not self._aborted(call.rids, generation):
            time.sleep(0.01)
        prompt_logprobs = None
        with self.generate_lock:
            aborted = self._aborted(call.rids, generation)
            samples = None if aborted else [
                self.generator.generate(call.context + call.ids, sp, top_logprobs=call.top_logprobs)
                for sp in call.sampling
            ]
            if samples is not None and call.prompt_logprobs:
                prompt_logprobs = self.generator.prompt_logprobs(call.ids, call.sampling[0].temperature)
            cached = self._cached_tokens(call.ids)
        results = []
        for i, sub_rid in enumerate(call.rids):
            if samples is None:
                results.append(self._aborted_result(sub_rid, call, body))
            else:
                results.append(self._result(sub_rid, call, samples[i], prompt_logprobs, body, cached, tic))
        with self.state_lock:
            self.stats["answered"] += 1
            self.stats["answered_aborted"] += samples is None
            self.stats["answer_order"].append(rid)
        return results[0] if len(call.rids) == 1 else results

    def _aborted(self, rids: list[str], generation: int) -> bool:
        with self.state_lock:
            return generation != self.abort_generation or any(r in self.aborted for r in rids)

    def _cached_tokens(self, ids: list[int]) -> int:
        best = 0
        for seen in self.seen_prompts:
            common = 0
            for a, b in zip(seen, ids, strict=False):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        self.seen_prompts.append(tuple(ids))
        return min(best, len(ids) - 1)

    def _result(self, rid: str, call: Call, sample: Sample, prompt_logprobs: list[float | None] | None,
                body: dict[str, Any], cached: int, tic: float) -> dict[str, Any]:
        tokens = sample.tokens
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": sample.finish,
            "prompt_tokens": len(call.ids),
            "weight_version": self.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(tokens),
            "cached_tokens": cached,
        }
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = (
                [[lp, t, None] for lp, t in zip(prompt_logprobs, call.ids, strict=True)] if prompt_logprobs else []
            )
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(sample.logprobs, tokens, strict=True)]
            meta["output_token_logprobs_length"] = len(tokens)
            if call.top_logprobs:
                meta["input_top_logprobs"] = [None] * len(meta["input_token_logprobs"])
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in position] for position in sample.top]
        if body.get("return_routed_experts") and self.routed_experts:
            meta["routed_experts"] = self._routed(call.ids, tokens, body.get("routed_experts_start_len") or 0)
        meta["e2e_latency"] = time.monotonic() - tic
        return {"text": sample.text, "output_ids": tokens, "meta_info": meta}

    def _routed(self, prompt: list[int], tokens: list[int], start: int) -> str:
        """Synthetic but deterministic top-k expert ids, [rows, layers, top_k] int32 LE base64."""
        layers, top_k, experts = self.routed_experts  # type: ignore[misc]
        sequence = np.asarray([*prompt, *tokens], dtype=np.int64)
        rows = max(0, len(sequence) - 1 - start)
        positions = np.arange(start, start + rows)
        ids = (sequence[positions][:, None, None] * 7 + positions[:, None, None] * 3
               + np.arange(layers)[None, :, None] * 5 + np.arange(top_k)[None, None, :]) % experts
        return base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode()

    def _aborted_result(self, rid: str, call: Call, body: dict[str, Any]) -> dict[str, Any]:
        """`tokenizer_manager._handle_abort_req`: aborted while waiting, so nothing generated or
        prefilled; with `return_logprob`, the (empty) logprob lists all the same."""
        meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort before prefill",
                                              "status_code": None, "err_type": None},
                "prompt_tokens": len(call.ids), "weight_version": self.weight_version,
                "completion_tokens": 0, "cached_tokens": 0}
        if body.get("return_logprob"):
            meta.update(input_token_logprobs=[], output_token_logprobs=[], output_token_logprobs_length=0)
            if body.get("top_logprobs_num"):
                meta.update(input_top_logprobs=[], output_top_logprobs=[])
        return {"text": "", "output_ids": [], "meta_info": meta}

    # -- lifecycle ---------------------------------------------------------------------------

    def health_generate(self) -> None:
        """One greedy token from token 0, like SGLang's /health_generate."""
        probe = load_sglang().sampling_params.SamplingParams(max_new_tokens=1, temperature=0.0)
        probe.normalize(self.generator.tokenizer)
        with self.generate_lock:
            self.generator.generate([0], probe)

    def model_info(self) -> dict[str, Any]:
        config = self.generator.config
        return {
            "model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": self.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": "null", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None),
        }

    def update_weights(self, body: Any) -> tuple[int, dict[str, Any]]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise ApiError(422, {"detail": [{"type": "missing", "loc": ["body", "model_path"],
                                             "msg": "Field required", "input": body}]})
        try:
            generator = Generator(body["model_path"])
        except Exception as exc:
            return 400, {"success": False, "num_paused_requests": 0,
                         "message": f"Failed to get weights iterator: {exc}. Rolling back to the old weights."}
        with self.generate_lock:  # waits for the request in flight, like SGLang's writer lock
            self.generator = generator
            self.model_path = body["model_path"]
            message = "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
                message += f" Weight version updated to {self.weight_version}."
            if body.get("flush_cache", True):
                self.seen_prompts.clear()
        return 200, {"success": True, "message": message, "num_paused_requests": 0}

    def pause(self, body: Any) -> dict[str, Any]:
        mode = (body or {}).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise ApiError(422, {"detail": [{"type": "literal_error", "loc": ["body", "mode"],
                                             "msg": "Input should be 'abort', 'retract' or 'in_place'"}]})
        with self.state_lock:
            if mode == "abort":
                self.abort_generation += 1
            self.running.clear()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        self.running.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def abort(self, body: Any) -> None:
        body = body or {}
        with self.state_lock:
            self.stats["abort_requests"].append(body)
            if body.get("abort_all"):
                self.abort_generation += 1
            elif body.get("rid"):
                self.aborted.add(str(body["rid"]))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StandinServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any = None, *, raw: bytes | None = None,
              content_type: str = "application/json") -> None:
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(422, {"detail": [{"type": "json_invalid", "loc": ["body", 0],
                                             "msg": "JSON decode error", "ctx": {"error": str(exc)}}]}) from exc

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        standin = self.server.standin
        path = self.path.split("?")[0]
        try:
            body = self._body() if method == "POST" else None
            if path in LIFECYCLE_PATHS:
                with standin.state_lock:
                    standin.stats["lifecycle"].append([method, path, body])
            if path == "/generate" and method == "POST":
                self._generate(body)
            elif path in ("/health", "/health_generate"):
                if path == "/health_generate":
                    standin.health_generate()
                self._send(200)
            elif path in standin.info_paths:
                self._send(200, standin.model_info())
            elif path in standin.server_info_paths:
                self._send(200, {"model_path": standin.model_path, "tokenizer_path": standin.model_path,
                                 "skip_tokenizer_init": False, "weight_version": "default",
                                 "enable_return_routed_experts": standin.routed_experts is not None,
                                 "internal_states": [{}], "version": "0.5.23-standin", "frontend": "python"})
            elif path == "/update_weights_from_disk" and method == "POST":
                self._send(*standin.update_weights(body))
            elif path == "/pause_generation" and method == "POST":
                self._send(200, standin.pause(body))
            elif path == "/continue_generation" and method == "POST":
                self._send(200, standin.resume())
            elif path == "/flush_cache":
                standin.seen_prompts.clear()
                self._send(200, raw=b"Cache flushed.\n", content_type="text/plain")
            elif path == "/abort_request" and method == "POST":
                standin.abort(body)
                self._send(200)
            elif path == "/load_lora_adapter" and method == "POST":
                self._send(*standin.loras.load(body))
            elif path == "/unload_lora_adapter" and method == "POST":
                self._send(*standin.loras.unload(body))
            elif path == "/_standin/faults" and method == "POST":
                self._send(200, standin.set_faults(body))
            elif path == "/_standin/stats":
                with standin.state_lock:
                    self._send(200, {**standin.stats, "loras": standin.loras.stats()})
            else:
                self._send(404, {"detail": "Not Found"})
        except (ApiError, LoraError) as exc:
            self._send(exc.status, exc.body)

    def _generate(self, body: Any) -> None:
        standin = self.server.standin
        with standin.state_lock:
            standin.stats["http_generate"] += 1
        rid = body.get("rid") if isinstance(body, dict) else None
        fault = standin.take_fault(str(rid or ""))
        if fault == "503":
            self._send(503, {"error": {"message": "stand-in: injected 503"}})
            return
        if fault == "drop":
            self.close_connection = True
            return
        answer = standin.generate(body)
        first = answer[0] if isinstance(answer, list) else answer
        if fault == "truncated":
            self._send(200, raw=json.dumps(answer).encode()[:40])
            return
        if fault == "no_meta":
            first.pop("meta_info")
        elif fault == "unknown_finish":
            first["meta_info"]["finish_reason"] = {"type": "exploded"}
        elif fault == "short_logprobs" and first["meta_info"].get("output_token_logprobs"):
            first["meta_info"]["output_token_logprobs"].pop()
        if body.get("stream"):
            self._stream(answer)
        else:
            self._send(200, answer)

    def _stream(self, answer: dict[str, Any]) -> None:
        """SGLang's cumulative SSE chunks (`tokenizer_manager._handle_batch_output`, stream without
        `--incremental-streaming-output`), the last one the whole answer, then `[DONE]`."""
        standin = self.server.standin
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        ids = answer["output_ids"]
        for k in range(1, len(ids)):
            meta = {"id": answer["meta_info"]["id"], "finish_reason": None, "completion_tokens": k}
            self.wfile.write(b"data: " + json.dumps({"text": None, "output_ids": ids[:k], "meta_info": meta}).encode()
                             + b"\n\n")
            self.wfile.flush()
            if k == standin.hold_streams_after:
                standin.streams_released.wait(60)
        self.wfile.write(b"data: " + json.dumps(answer).encode() + b"\n\n")
        self.wfile.flush()
        if len(ids) == standin.hold_streams_after:  # the last chunk out, the answer not yet ended
            standin.streams_released.wait(60)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class StandinServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], standin: Standin) -> None:
        super().__init__(address, Handler)
        self.standin = standin


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--routed-experts", default=None, help="LAYERS,TOP_K,NUM_EXPERTS: return synthetic routings")
    parser.add_argument("--only-get-info", action="store_true",
                        help="serve /get_model_info and /get_server_info only, like SGLang 0.4.6")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters, like SGLang's --enable-lora")
    args = parser.parse_args(argv)
    routed = tuple(int(x) for x in args.routed_experts.split(",")) if args.routed_experts else None
    standin = Standin(args.model, weight_version=args.weight_version, routed_experts=routed,  # type: ignore[arg-type]
                      only_get_info=args.only_get_info, enable_lora=args.enable_lora)
    server = StandinServer((args.host, args.port), standin)
    print(f"sglang stand-in serving {args.model} on http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
