"""The `sglang-http` engine: SGLang servers, or gateways in front of them, over native `POST /generate`.

Batching, the concurrent interface and partial-swap interrupts are `http_engine.HTTPEngine`'s;
see `sglang_client` for the wire (aborts by rid) and `sglang_mapping` for the format. The lifecycle
calls (`update_weights` → `/update_weights_from_disk`, `pause_generation`, `continue_generation`,
`flush_cache`, `abort`) go to every SGLang server directly, those behind a gateway included
(`workers.engines.http.backends`): gateways do not serve them. The `health` probe goes where generation goes.

Partial weight swaps (`interrupt`): `/abort_request` by rid for each of this worker's calls in
flight, on the server it went to (behind a gateway, every server behind it). SGLang answers each
aborted `/generate` normally, with the tokens it generated so far and a finish of type `abort`.

LoRA adapters (servers launched with `--enable-lora`): the adapters a batch names are loaded on
every server before it is sent, under their pinned names, `max_adapters` kept resident (LRU,
`workers.engines.adapters.cache`); see `workers.engines.sglang.adapters`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from pipeline.core.weights.safetensors_io import TensorBits
from schemas.adapters import AdapterRecord
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from workers.engines.adapters import files as adapter_files
from workers.engines.adapters.cache import DEFAULT_MAX_ADAPTERS, AdapterCache
from workers.engines.base import EngineDescription, SampleOutput
from workers.engines.http.backends import Answer, error_message, parse_weight_version
from workers.engines.http.engine import HTTPEngine
from workers.engines.sglang import adapters
from workers.engines.sglang.client import RetryPolicy, SGLangClient
from workers.engines.sglang.expert_ids import ExpertsLayout
from workers.engines.sglang.mapping import GenerateCall, generate_calls, parse_call_results
from workers.errors import EngineUnavailableError, UnsupportedRequestError

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class SGLangHTTPEngine(HTTPEngine):
    """One worker's view of one or more SGLang servers (or gateways in front of them)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_top_logprobs: int = 0,
        routed_experts: bool = False,
        experts_layout: ExpertsLayout | None = None,
        weight_version: int = 0,
        model_name: str | None = None,
        vocab_size: int | None = None,
        has_tokenizer: bool = True,
        max_in_flight: int = 256,
        timeout_s: float = 3600.0,
        connect_timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
        adapter_dir: Path | None = None,
    ) -> None:
        super().__init__(name="sglang-http")
        self.adapters = AdapterCache(self._load_adapter, self._unload_adapter, max_adapters)
        self._adapter_dir = adapter_dir or adapter_files.default_directory()
        self._client = SGLangClient(
            urls, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
            max_in_flight=max_in_flight, retry=retry, transport=transport,
        )
        try:
            self._bridge.run(self._client.backends.discover())
            infos = self.model_info()
        except BaseException:
            self.close()
            raise
        first = infos[self.servers[0]]
        model_path = str(first.get("model_path") or "unknown")
        self.model_path = model_path
        versions = {url: info.get("weight_version") for url, info in infos.items()}
        if len(set(map(str, versions.values()))) > 1:
            log.warning("SGLang servers report different weight versions: %s", versions)
        served = parse_weight_version(first.get("weight_version"))
        self._weight_version = weight_version if served is None else served
        if routed_experts and experts_layout is None:
            experts_layout = ExpertsLayout.from_model_config(model_path)
            if experts_layout is None:
                self.close()
                raise EngineUnavailableError(
                    "routed experts need the expert layout: the model's config.json at "
                    f"{model_path!r} is not readable here or has no num_experts_per_tok; "
                    "pass experts_layout (layers, top_k, num_experts)"
                )
        self._layout = experts_layout if routed_experts else None
        self._description = EngineDescription(
            name="sglang-http",
            model=model_name or model_path,
            capabilities=Capabilities(
                max_top_logprobs=max_top_logprobs,
                prompt_logprobs=True,
                routed_experts=routed_experts,
                vocab_size=vocab_size,
            ),
            num_experts=self._layout.num_experts if self._layout else None,
            has_tokenizer=has_tokenizer,
        )

    @property
    def servers(self) -> list[str]:
        """Where lifecycle calls go: every SGLang server, those behind a gateway included."""
        return self._client.backends.servers()

    def _plan(self, request: RolloutRequest) -> list[GenerateCall]:
        return generate_calls(request)

    def _prepare(self, requests: Sequence[RolloutRequest]) -> None:
        self.adapters.ensure(r.adapter for r in requests if r.adapter is not None)

    async def _generate(self, call: GenerateCall, live: Any = None) -> list[SampleOutput]:
        try:
            return await super()._generate(call, live)
        except UnsupportedRequestError as exc:
            key = call.request.adapter
            if key is None or adapters.NEVER_LOADED not in str(exc):
                raise
            self.adapters.forget(key)
            raise UnsupportedRequestError(
                f"request {call.request.id!r}: adapter {key} is no longer loaded on the SGLang server (restarted?); "
                f"the job is handed back, and the adapter is loaded again before it runs here ({exc})") from exc

    def _stream_sink(self, call: GenerateCall) -> CumulativeChunks:
        return CumulativeChunks()

    def _parse(self, call: GenerateCall, url: str, body: Any) -> list[SampleOutput]:
        gateway = url if url in self._client.backends.gateways else None
        return parse_call_results(call, body, layout=self._layout, gateway=gateway)

    # -- lifecycle ---------------------------------------------------------------------------

    def _load_adapter(self, key: str, record: AdapterRecord, tensors: list[TensorBits]) -> None:
        """Materialise adapter `key` where the servers read it, then load it on each under that name."""
        path = adapter_files.materialise(self._adapter_dir, key, record, tensors)
        answers = self._bridge.run(self._client.backends.fan_out(
            "POST", "/load_lora_adapter", {"lora_name": key, "lora_path": str(path)}, timeout_s=600, rediscover=True))
        failures = []
        for url, answer in answers.items():
            if isinstance(answer, httpx.Response) and (answer.status_code < 400
                                                       or adapters.ALREADY_LOADED in error_message(answer)):
                continue
            failures.append(self._client.backends.describe(url, answer))
        if failures:
            raise ValueError(f"SGLang POST /load_lora_adapter ({path}) failed on " + "; ".join(failures)
                             + " (is the server launched with --enable-lora, and can it read that path?)")

    def _unload_adapter(self, key: str) -> None:
        """Unload adapter `key` from every server; best effort (a server that restarted has it no more):
        a failure is logged, and the adapter is loaded again whenever a batch needs it."""
        answers = self._bridge.run(self._client.backends.fan_out("POST", "/unload_lora_adapter", {"lora_name": key},
                                                                 timeout_s=600))
        for url, answer in answers.items():
            if not (isinstance(answer, httpx.Response) and answer.status_code < 400):
                log.warning("SGLang POST /unload_lora_adapter %s: %s", key, self._client.backends.describe(url, answer))

    def _each(self, method: str, path: str, json: dict[str, Any] | None = None, *,
              timeout_s: float | None = None, rediscover: bool = False) -> dict[str, httpx.Response]:
        """Call every SGLang server; raise naming each one that failed."""
        answers = self._bridge.run(
            self._client.backends.fan_out(method, path, json, timeout_s=timeout_s, rediscover=rediscover)
        )
        return self._all_answered(f"{method} {path}", answers)

    def model_info(self) -> dict[str, dict[str, Any]]:
        """Every server's `GET /model_info` (model_path, weight_version, ...); `GET /get_model_info`
        where a server does not serve the former (SGLang before 0.5)."""
        backends = self._client.backends
        answers = self._bridge.run(backends.fan_out("GET", "/model_info", timeout_s=30))
        older = [url for url, answer in answers.items() if _is_404(answer)]
        if older:
            answers.update(self._bridge.run(backends.each("GET", "/get_model_info", timeout_s=30, servers=older)))
        unknown = [url for url in older if _is_404(answers[url])]
        if unknown:
            raise EngineUnavailableError(
                f"{', '.join(unknown)} serve(s) neither GET /model_info nor GET /get_model_info (404): not an "
                "SGLang server, and not a gateway either (a gateway serves GET /workers); check the --url"
            )
        infos = {}
        for url, response in self._all_answered("GET /model_info (and /get_model_info)", answers).items():
            try:
                body = response.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                raise EngineUnavailableError(f"{url}/model_info did not answer a JSON object; is it SGLang?")
            infos[url] = body
        return infos

    def health(self) -> None:
        """`GET /health_generate` (a real one-token generation) on every URL generation goes to:
        each server, or the gateway (which picks a server); raises if any fails."""
        answers = self._bridge.run(
            self._client.backends.each("GET", "/health_generate", timeout_s=60, servers=self.urls)
        )
        self._all_answered("GET /health_generate", answers)

    def update_weights(self, path: str, version: int, *, abort_all_requests: bool = False) -> None:
        """SGLang's `/update_weights_from_disk` on every server (the list behind each gateway read
        again first), tagging the weights `version`; raises naming the servers that failed."""
        body = {"model_path": str(path), "weight_version": str(version), "abort_all_requests": abort_all_requests}
        answers = self._each("POST", "/update_weights_from_disk", body, rediscover=True)
        failures = []
        for url, response in answers.items():
            try:
                answer = response.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict) or answer.get("success") is not True:
                failures.append(f"{url}: {error_message(response)}")
        if failures:
            raise EngineUnavailableError("update_weights_from_disk failed on " + "; ".join(failures))
        self._weight_version = version

    def pause_generation(self, mode: str = "abort") -> None:
        """`/pause_generation` on every server (the list behind each gateway read again first)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self._each("POST", "/pause_generation", {"mode": mode}, rediscover=True)

    def continue_generation(self) -> None:
        self._each("POST", "/continue_generation", {})

    def flush_cache(self) -> None:
        self._each("POST", "/flush_cache")

    def abort(self, rid: str) -> dict[str, Answer]:
        """Abort the SGLang request `rid` wherever it runs: `/abort_request` on every server, since
        behind a gateway the worker does not know which one holds it. What each server answered
        (an `httpx.Response`, or the `httpx.HTTPError` that kept it from answering)."""
        return self._bridge.run(self._client.backends.abort(rid))

    def abort_all(self) -> dict[str, Answer]:
        """Abort everything in flight on every server; what each answered, as for `abort`."""
        return self._bridge.run(self._client.backends.abort_all())


class CumulativeChunks:
    """SGLang's streamed `/generate` (its default, not `--incremental-streaming-output`): each chunk
    holds the `output_ids` so far, and the last one is the whole answer."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.last: Any = None

    def take(self, chunk: Any) -> None:
        self.last = chunk

    def so_far(self) -> list[int]:
        ids = self.last.get("output_ids") if isinstance(self.last, dict) else None
        return [int(t) for t in ids] if isinstance(ids, list) else []

    def answer(self) -> Any:
        return self.last


def _is_404(answer: Answer) -> bool:
    return isinstance(answer, httpx.Response) and answer.status_code == 404
