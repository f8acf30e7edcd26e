"""The `vllm-http` engine: vLLM servers over their OpenAI-compatible `POST /v1/completions`.

Token ids in, token ids out: the prompt goes as token ids with `return_token_ids`
(`vllm_mapping`). Batching, the concurrent interface and partial-swap interrupts are
`http_engine.HTTPEngine`'s; retries, URL choice and aborts are `http_client`'s.

Why `/v1/completions` and not vLLM's token-in/token-out `/inference/v1/generate`: the latter
answers 403 unless the server runs with `--enable-scale-out`, while every vLLM server serves the
former, and it carries everything the contracts need (token ids, chosen and top-k logprobs by
token id, prompt logprobs, finish and stop reasons per choice).

Logprob semantics depend on the server's `--logprobs-mode`; the engine reads it at start (from
`GET /server_info` on a server with development endpoints, else from a two-request probe, see
`probe_logprobs_mode`) and registers what it serves exactly as its capabilities
(`vllm_mapping.logprob_capabilities`; the rules are `schemas.capabilities.SAMPLING_RULES`), so a
submit fails fast and a mixed pool routes such requests to other engines; what the server cannot
serve is refused with `UnsupportedRequestError`. Greedy requests without penalties are served in
either logprobs mode.

Lifecycle: `health` (`GET /health`), `models` (`GET /v1/models`), `version` (`GET /version`)
work on every server. Weight reloads, pause/resume, prefix-cache resets, aborts by request id
(and so partial swaps) need vLLM's development endpoints: start the server with
`VLLM_SERVER_DEV_MODE=1` (vllm/envs.py; routes in vllm/entrypoints/rl/online/api_router.py and
vllm/entrypoints/serve/dev/). A weight reload pauses each server (`POST /pause?mode=wait`), calls
`reload_weights(weights_path=...)` on its workers (`POST /collective_rpc`), resets the prefix
cache (its KV was computed with the old weights), tags the weights (`POST
/update_weight_version`) and resumes. A cancelled call closes its connection, which vLLM takes as
an abort (`with_cancellation`); a partial swap aborts by id (`POST /abort_requests`), and vLLM
answers each aborted completion with what it generated so far and `finish_reason: abort`.

LoRA adapters (servers started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, which
adds vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`; vllm/entrypoints/serve/lora/): the
adapters a batch names are written to PEFT directories (`workers.engines.adapters.files`) and loaded
on every server under their pinned names (`NAME@vN`) before it is sent, `max_adapters` kept
resident (LRU, `workers.engines.adapters.cache`); a completion names its adapter in `model`. vLLM
0.32 can also reload an adapter in place under the same name (`load_inplace`); the engine does not:
a job pins one version, and its rows say which, so each version is its own name. A server that lost
an adapter (restarted) answers 404 "The model `NAME@vN` does not exist": the job is handed back,
never served by the base, and the adapter loaded again before it runs here next.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from pipeline.core.weights.manifest import Manifest
from pipeline.core.weights.safetensors_io import TensorBits
from pipeline.core.weights.store import WeightStore, version_dir
from schemas.adapters import AdapterRecord
from schemas.request import RolloutRequest
from schemas.worker_info import Capabilities
from workers.engines import model_config
from workers.engines.adapters import files as adapter_files
from workers.engines.adapters.cache import DEFAULT_MAX_ADAPTERS, AdapterCache
from workers.engines.base import EngineDescription, SampleOutput
from workers.engines.http.backends import Answer, Backends, answered, error_message, parse_weight_version
from workers.engines.http.client import Aborts, GenerateClient, RetryPolicy, Wire
from workers.engines.http.engine import HTTPEngine
from workers.engines.request_support import check_request_supported
from workers.engines.vllm.mapping import (
    LOGPROBS_MODES,
    PROCESSED_LOGPROBS,
    RAW_LOGPROBS,
    CompletionCall,
    DeltaChunks,
    completion_calls,
    logprob_capabilities,
    parse_completion,
    refusal,
    streamable,
    token_of,
)
from workers.errors import EngineUnavailableError, UnsupportedRequestError

if TYPE_CHECKING:
    from workers.engines.inplace import Applied  # torch: imported only where a store version is applied

log = logging.getLogger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
PAUSE_MODES = ("abort", "wait", "keep")  # vllm/v1/engine/__init__.py: PauseMode
# The worker extension the project ships (`--worker-extension-cls`): weight-store versions applied in place.
WEIGHT_EXTENSION = "workers.engines.vllm.weight_extension.RolloutWeightExtension"
# vLLM's answers: a completion naming an adapter it has no record of (never loaded, lost in a restart),
# and a load of a name it serves already (vllm/entrypoints/openai/models/serving.py).
UNKNOWN_MODEL = "does not exist"
ALREADY_LOADED = "has already been loaded"
LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
STAGING_POLL_S = 0.05
STAGING_TIMEOUT_S = 1800.0
_PROBE_TOP = 5
_PROBE_TOLERANCE = 1e-3


@dataclass(frozen=True)
class StagedOnServers:
    """A store version every server's weight extension has computed and checked, not yet fed to vLLM."""

    version: int
    url: str


def vllm_wire(backends: Backends) -> Wire:
    async def abort(url: str, ids: list[str], timeout_s: float) -> Aborts:
        answers = await backends.each("POST", "/abort_requests", {"request_ids": ids}, timeout_s=timeout_s,
                                      servers=[url])
        return dict.fromkeys(ids, answers)

    return Wire(server="vLLM", path="/v1/completions", ids=lambda call: call.vllm_ids, abort=abort)


class VLLMHTTPEngine(HTTPEngine):
    """One worker's view of one or more vLLM servers serving the same model."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_top_logprobs: int = 0,
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
        super().__init__(name="vllm-http")
        self.adapters = AdapterCache(self._load_adapter, self._unload_adapter, max_adapters)
        self._adapter_dir = adapter_dir or adapter_files.default_directory()
        self._client = GenerateClient(urls, vllm_wire, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                      max_in_flight=max_in_flight, retry=retry, transport=transport)
        try:
            self._start(max_top_logprobs, weight_version, model_name, vocab_size, has_tokenizer)
        except BaseException:
            self.close()
            raise

    def _start(self, max_top_logprobs: int, weight_version: int, model_name: str | None,
               vocab_size: int | None, has_tokenizer: bool) -> None:
        cards = {url: models[0] for url, models in self.models().items()}
        roots = {url: str(card.get("root") or card.get("id")) for url, card in cards.items()}
        if len(set(roots.values())) > 1:
            log.warning("vLLM servers serve different models: %s", roots)
        first = self.urls[0]
        self.model_path = roots[first]
        paused = self._bridge.run(self._client.backends.each("GET", "/is_paused", timeout_s=30))
        self.dev_mode = {url: answered(answer) for url, answer in paused.items()}
        infos = self.server_info()
        # Where the configuration is readable: which servers were started without --enable-lora.
        self._no_lora = [url for url, info in infos.items() if info and info.get("vllm_config", {}).get("lora_config")
                         is None]
        modes = {url: _config(info, "logprobs_mode") if info else None for url, info in infos.items()}
        for url in [u for u, mode in modes.items() if mode not in LOGPROBS_MODES]:
            modes[url] = self._bridge.run(probe_logprobs_mode(self._client.client, url))
        if len(set(modes.values())) > 1:
            raise EngineUnavailableError(
                f"the vLLM servers run different --logprobs-mode settings ({modes}); one worker serves "
                "rows under one logprob semantics: start them alike"
            )
        self.logprobs_mode: str = modes[first]  # type: ignore[assignment]
        limits = [limit for info in infos.values() if info and isinstance(limit := _config(info, "max_logprobs"), int)]
        if max_top_logprobs and limits and 0 <= min(limits) < max_top_logprobs:
            raise EngineUnavailableError(
                f"--max-top-logprobs {max_top_logprobs} is over the vLLM server's --max-logprobs {min(limits)}; "
                "lower it or restart the server with a higher --max-logprobs"
            )
        served = None
        if all(self.dev_mode.values()):
            versions = self.weight_info()
            if len(set(versions.values())) > 1:
                log.warning("vLLM servers report different weight versions: %s", versions)
            served = parse_weight_version(versions[first])
        self._weight_version = weight_version if served is None else served
        extensions = {url: _config(info, "worker_extension_cls", "parallel_config") if info else None
                      for url, info in infos.items()}
        if all(self.dev_mode.values()) and all(ext == WEIGHT_EXTENSION for ext in extensions.values()):
            # Only then: a worker looks these up to choose staged or in-place over a materialised full load.
            self.apply_store_version = self._apply_store_version
            self.stage_store_version = self._stage_store_version
            self.install_store_version = self._install_store_version
        if vocab_size is None:
            vocab_size = model_config.vocab_size(self.model_path)
        self._description = EngineDescription(
            name="vllm-http",
            model=model_name or self.model_path,
            capabilities=Capabilities(max_top_logprobs=max_top_logprobs, prompt_logprobs=True, routed_experts=False,
                                      vocab_size=vocab_size,
                                      **logprob_capabilities(self.logprobs_mode)),
            has_tokenizer=has_tokenizer,
        )
        log.info("vllm-http: %s serving %s (logprobs mode %s, development endpoints %s)", self.urls,
                 self.model_path, self.logprobs_mode,
                 "on" if all(self.dev_mode.values()) else f"off ({DEV_MODE_ENV} unset)")

    # -- generation --------------------------------------------------------------------------

    def _plan(self, request: RolloutRequest) -> list[CompletionCall]:
        check_request_supported(request, self._description.served)  # the worker checks too; `generate` may not
        reason = refusal(request, self.logprobs_mode)
        if reason:
            raise UnsupportedRequestError(reason)
        return completion_calls(request)

    def _prepare(self, requests: Sequence[RolloutRequest]) -> None:
        self.adapters.ensure(r.adapter for r in requests if r.adapter is not None)

    async def _generate(self, call: CompletionCall, live: Any = None) -> list[SampleOutput]:
        try:
            return await super()._generate(call, live)
        except UnsupportedRequestError as exc:
            key = call.request.adapter
            if key is None or UNKNOWN_MODEL not in str(exc):
                raise
            self.adapters.forget(key)
            raise UnsupportedRequestError(
                f"request {call.request.id!r}: adapter {key} is no longer loaded on the vLLM server (restarted?); "
                f"the job is handed back, and the adapter is loaded again before it runs here ({exc})") from exc

    def _parse(self, call: CompletionCall, url: str, body: Any) -> list[SampleOutput]:
        return parse_completion(call, body)

    def _stream_sink(self, call: CompletionCall) -> DeltaChunks | None:
        return DeltaChunks() if streamable(call) else None

    def interrupt(self) -> int:
        """Abort this worker's calls in flight by id (`POST /abort_requests`, a development endpoint)."""
        self._require_dev_mode("a partial weight swap (aborting requests by id)")
        return super().interrupt()

    # -- lifecycle ---------------------------------------------------------------------------

    def _load_adapter(self, key: str, record: AdapterRecord, tensors: list[TensorBits]) -> None:
        """Materialise adapter `key` where the servers read it, then load it on each under that name."""
        if self._no_lora:
            raise ValueError(f"the vLLM server(s) {', '.join(self._no_lora)} were started without --enable-lora "
                             f"(restart them with --enable-lora --max-lora-rank R and {LORA_ENV}=1)")
        path = adapter_files.materialise(self._adapter_dir, key, record, tensors)
        answers = self._bridge.run(self._client.backends.each(
            "POST", "/v1/load_lora_adapter", {"lora_name": key, "lora_path": str(path)}, timeout_s=600))
        failures = []
        for url, answer in answers.items():
            if isinstance(answer, httpx.Response) and (answer.status_code < 400
                                                       or ALREADY_LOADED in error_message(answer)):
                continue
            hint = (f"it serves no /v1/load_lora_adapter: restart it with {LORA_ENV}=1"
                    if isinstance(answer, httpx.Response) and answer.status_code == 404 else
                    "is it started with --enable-lora and a --max-lora-rank of at least the adapter's, and can it "
                    "read that path?")
            failures.append(f"{self._client.backends.describe(url, answer)} ({hint})")
        if failures:
            raise ValueError(f"vLLM POST /v1/load_lora_adapter ({path}) failed on " + "; ".join(failures))

    def _unload_adapter(self, key: str) -> None:
        """Unload adapter `key` from every server; best effort (a server that restarted has it no more):
        a failure is logged, and the adapter is loaded again whenever a batch needs it."""
        answers = self._bridge.run(self._client.backends.each("POST", "/v1/unload_lora_adapter", {"lora_name": key},
                                                              timeout_s=600))
        for url, answer in answers.items():
            if not (isinstance(answer, httpx.Response) and answer.status_code < 400):
                log.warning("vLLM POST /v1/unload_lora_adapter %s: %s", key,
                            self._client.backends.describe(url, answer))

    def _each(self, method: str, path: str, json: Any = None, *,
              timeout_s: float | None = None) -> dict[str, httpx.Response]:
        """The same call on every server; raise naming each one that failed."""
        answers = self._bridge.run(self._client.backends.each(method, path, json, timeout_s=timeout_s))
        return self._all_answered(f"{method} {path}", answers)

    def _each_json(self, method: str, path: str, json: Any = None, *,
                   timeout_s: float | None = None) -> dict[str, Any]:
        bodies = {}
        for url, response in self._each(method, path, json, timeout_s=timeout_s).items():
            try:
                bodies[url] = response.json()
            except ValueError:
                raise EngineUnavailableError(f"{url}{path} did not answer JSON: {response.text[:200]!r}; "
                                             "is it a vLLM server?") from None
        return bodies

    def _require_dev_mode(self, what: str) -> None:
        missing = [url for url, on in self.dev_mode.items() if not on]
        if missing:
            raise EngineUnavailableError(
                f"{what} needs vLLM's development endpoints, which {', '.join(missing)} do(es) not serve: "
                f"restart the server(s) with the environment variable {DEV_MODE_ENV}=1"
            )

    def models(self) -> dict[str, list[dict[str, Any]]]:
        """Every server's `GET /v1/models` list (`id`: the served name, `root`: the model path)."""
        models = {}
        for url, body in self._each_json("GET", "/v1/models", timeout_s=30).items():
            data = body.get("data") if isinstance(body, dict) else None
            if not isinstance(data, list) or not data or not all(isinstance(card, dict) for card in data):
                raise EngineUnavailableError(f"{url}/v1/models lists no model ({str(body)[:200]}); is it vLLM?")
            models[url] = data
        return models

    def version(self) -> dict[str, str]:
        """Every server's vLLM version (`GET /version`)."""
        return {url: str(body.get("version")) for url, body in self._each_json("GET", "/version", timeout_s=30).items()}

    def server_info(self) -> dict[str, dict[str, Any] | None]:
        """Every server's configuration (`GET /server_info?config_format=json`, a development
        endpoint), None where it is not served."""
        answers = self._bridge.run(self._client.backends.each("GET", "/server_info?config_format=json", timeout_s=60))
        infos: dict[str, dict[str, Any] | None] = {}
        for url, answer in answers.items():
            body = None
            if isinstance(answer, httpx.HTTPError):
                self._all_answered("GET /server_info", {url: answer})  # raises: unreachable
            elif answer.status_code != 404:
                try:
                    body = answer.json() if answered(answer) else None
                except ValueError:
                    body = None
                if body is None:
                    log.warning("%s/server_info answered HTTP %d: %s", url, answer.status_code, error_message(answer))
            infos[url] = body if isinstance(body, dict) else None
        return infos

    def weight_info(self) -> dict[str, Any]:
        """Every server's weight version (`GET /weight_info`: "default" until tagged)."""
        self._require_dev_mode("reading the weight version")
        return {url: body.get("weight_version") if isinstance(body, dict) else None
                for url, body in self._each_json("GET", "/weight_info", timeout_s=30).items()}

    def health(self) -> None:
        """`GET /health` on every server (200 while its engine lives); raises if any fails."""
        self._each("GET", "/health", timeout_s=60)

    def update_weights(self, path: str, version: int) -> None:
        """Reload the weights from `path` on every server and tag them `version`: pause (requests in
        flight finish, new ones wait), `reload_weights`, reset the prefix cache, tag, resume."""
        self._require_dev_mode("a weight reload")
        check_weights_dir(path, served=self.model_path)

        def reload() -> None:
            self._each("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            if hasattr(self, "apply_store_version"):  # the extension's copy of a store version is stale now
                self._each("POST", "/collective_rpc", {"method": "rollout_forget_store"})

        self._paused_swap(version, reload)

    def _extension_call(self, method: str, args: list[Any], what: str) -> list[dict[str, Any]]:
        """`POST /collective_rpc` of an extension method on every server: each vLLM worker's answer;
        raises `EngineUnavailableError` naming the server where one is not ok."""
        answers: list[dict[str, Any]] = []
        for url, body in self._each_json("POST", "/collective_rpc", {"method": method, "args": args}).items():
            results = body.get("results") if isinstance(body, dict) else None
            if not isinstance(results, list) or not results:
                raise EngineUnavailableError(f"{url}/collective_rpc {method} answered {str(body)[:300]}")
            for answer in results:
                if not (isinstance(answer, dict) and answer.get("ok") is True):
                    error = answer.get("error") if isinstance(answer, dict) else answer
                    raise EngineUnavailableError(f"{url}: the weight extension could not {what}: {error}")
                answers.append(answer)
        return answers

    def _apply_store_version(self, store: WeightStore, have: int | None, version: int) -> Applied:
        """Bring every server to `version` of the weight store through the worker extension
        (`weight_extension.RolloutWeightExtension`, `rollout_apply_store`), all of it in the pause:
        the deltas from `have` applied to its copy and every checksum checked, or a full rebuild from
        the store (said why). Bound to `apply_store_version` only when every server runs the extension."""
        return self._paused_extension_call(version, "rollout_apply_store", [store_plan(store, have, version)],
                                           f"load v{version} of {store.url}")

    def _stage_store_version(self, store: WeightStore, have: int | None, version: int) -> StagedOnServers:
        """Every server's extension computes `version` and checks it (`rollout_stage_store`, on a
        thread of its own) while vLLM keeps generating; returns once all are done. Bound to
        `stage_store_version` with the extension (`workers.process.store_load` calls it before the pause)."""
        what = f"stage v{version} of {store.url}"
        self._extension_call("rollout_stage_store", [store_plan(store, have, version)], what)
        deadline = time.monotonic() + STAGING_TIMEOUT_S
        while True:
            answers = self._extension_call("rollout_staged", [], what)
            if all(answer.get("done") for answer in answers):
                return StagedOnServers(version, store.url)
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"the vLLM weight extension did not finish staging v{version} of "
                                             f"{store.url} in {STAGING_TIMEOUT_S:.0f} s")
            time.sleep(STAGING_POLL_S)  # each poll runs in vLLM's model-step loop: not every millisecond

    def _install_store_version(self, staged: StagedOnServers) -> Applied:
        """The staged version fed to vLLM on every server (`rollout_install_store`), in the same pause
        as a reload."""
        return self._paused_extension_call(staged.version, "rollout_install_store", [staged.version],
                                           f"install v{staged.version} of {staged.url}")

    def _paused_extension_call(self, version: int, method: str, args: list[Any], what: str) -> Applied:
        """An extension method that changes vLLM's weights, called in a reload's pause (`_paused_swap`);
        what the vLLM workers did, as the worker's ack reports it."""
        from workers.engines.inplace import Applied

        results: list[dict[str, Any]] = []
        self._paused_swap(version, lambda: results.extend(self._extension_call(method, args, what)))
        self.last_store_results = results  # each vLLM worker's answer: how, bytes, tensors fed and read back, seconds
        full = [r for r in results if r.get("how") == "full"]
        details = sorted({str(r["detail"]) for r in results if r.get("detail")})
        return Applied(version=version, how="full" if full else "delta",
                       bytes_read=sum(int(r.get("bytes_read", 0)) for r in results),
                       tensors_changed=max(int(r.get("tensors_changed", 0)) for r in results),
                       detail="; ".join(details) or None)

    def _paused_swap(self, version: int, swap: Callable[[], Any]) -> None:
        """Pause every server (`wait`: requests in flight finish), `swap()` the weights, reset the prefix
        cache (its KV was computed with the old weights), tag them `version`, resume (in a `finally`)."""
        done = False
        try:
            self.pause_generation("wait")
            swap()
            self.flush_cache()
            self._each("POST", "/update_weight_version", {"new_version": str(version)}, timeout_s=60)
            done = True
        finally:
            try:
                self.continue_generation()  # every server, paused by this call or not
            except EngineUnavailableError as exc:
                if done:
                    raise
                log.warning("after the failed weight swap, resuming failed too: %s", exc)
        self._weight_version = version

    def pause_generation(self, mode: str = "wait") -> None:
        """`POST /pause?mode=` on every server: `wait` lets requests in flight finish, `abort` ends
        them (each answers with what it generated), `keep` freezes them until `continue_generation`."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
        self._require_dev_mode("pausing")
        self._each("POST", f"/pause?mode={mode}")

    def continue_generation(self) -> None:
        self._require_dev_mode("resuming")
        self._each("POST", "/resume", timeout_s=60)

    def is_paused(self) -> dict[str, bool]:
        self._require_dev_mode("reading the pause state")
        return {url: body.get("is_paused") is True for url, body in self._each_json("GET", "/is_paused").items()}

    def flush_cache(self) -> None:
        """`POST /reset_prefix_cache` on every server; raises where it did not reset (blocks still held)."""
        self._require_dev_mode("resetting the prefix cache")
        failed = [url for url, body in self._each_json("POST", "/reset_prefix_cache", timeout_s=60).items()
                  if not (isinstance(body, dict) and body.get("success") is True)]
        if failed:
            raise EngineUnavailableError(f"vLLM could not reset the prefix cache on {', '.join(failed)} "
                                         "(requests still hold blocks); pause the server first")

    def abort_all(self) -> dict[str, Answer]:
        """Abort everything in flight on every server (`POST /abort_requests {}`); what each answered
        (an `httpx.Response`, or the `httpx.HTTPError` that kept it from answering)."""
        self._require_dev_mode("aborting requests")
        return self._bridge.run(self._client.backends.each("POST", "/abort_requests", {}, timeout_s=30))


def check_weights_dir(path: str, served: str | None = None) -> None:
    """Refuse a reload vLLM 0.32 would get wrong, before the server sees it:

    - a path it cannot load: it answers HTTP 500 and its engine dies (the server exits). The path
      must be a directory holding the checkpoint (*.safetensors or *.bin), as the worker sees it
      (the server must see it at the same path);
    - a model whose embeddings are tied (`tie_word_embeddings: true` in the new checkpoint's
      config.json, or in that of the model the server serves, `served`, when readable here): the
      in-place reload skips the tied output projection (its log: "ParallelLMHead: Failed to load
      weights"), so the server would serve the new body with the old lm_head, silently
      (vllm/model_executor/model_loader/reload/inplace.py, layerwise.py).
    """
    where = Path(path)
    if not where.is_dir():
        raise EngineUnavailableError(
            f"weights path {path!r} is not a directory here; vLLM's reload needs a checkpoint directory that this "
            "worker and the server both see at that path (a reload from a path vLLM cannot load kills its engine)"
        )
    if not any(where.glob("*.safetensors")) and not any(where.glob("*.bin")):
        raise EngineUnavailableError(
            f"weights path {path!r} holds no *.safetensors or *.bin checkpoint files; vLLM's reload would fail "
            "and kill its engine"
        )
    for directory in (where, Path(served) if served else None):
        if directory is not None and model_config.ties_embeddings(directory):
            raise EngineUnavailableError(
                f"{directory}/config.json ties the word embeddings (tie_word_embeddings: true): vLLM 0.32's in-place "
                "reload skips a tied lm_head (ParallelLMHead: Failed to load weights) and would serve the new "
                "weights with the old output projection; save the checkpoints untied (lm_head.weight written, "
                "tie_word_embeddings: false) and start the server on an untied copy, or restart the server on "
                "the new path"
            )


def _config(info: dict[str, Any], key: str, section: str = "model_config") -> Any:
    """A field of `server_info`'s `vllm_config.<section>`."""
    config = info.get("vllm_config")
    part = config.get(section) if isinstance(config, dict) else None
    return part.get(key) if isinstance(part, dict) else None


def store_plan(store: WeightStore, have: int | None, version: int) -> str:
    """What the worker extension needs to bring a server to `version`, as JSON, from the store's
    validated manifests: the deltas from `have` (null when the store has no chain from it), the
    full chain (the fallback), and every tensor's checksum at `version`. Each step names its
    directory; the extension reads the blobs there (the server must see the store's URL too)."""
    def step(manifest: Manifest) -> dict[str, Any]:
        return {"version": manifest.version, "dir": f"{store.url}/{version_dir(manifest.version)}",
                "tensors": [entry.model_dump(mode="json") for entry in manifest.tensors]}

    deltas = store.deltas_between(have, version) if have is not None and have != version else None
    final = store.manifest(version)
    return json.dumps({
        "url": store.url, "version": version, "have": have,
        "deltas": [step(m) for m in deltas] if deltas else None,
        "chain": [step(m) for m in store.chain(version)],
        "final": [{"name": e.name, "dtype": e.dtype, "shape": e.shape, "xxh3": e.xxh3} for e in final.tensors],
    })


async def probe_logprobs_mode(http: httpx.AsyncClient, url: str) -> str:
    """The server's `--logprobs-mode`, from outside: the same one-token completion, greedy and at
    temperature 2, with the top-5 logprobs. raw_logprobs are the same at both temperatures;
    processed_logprobs change with it; logits modes give values no log-probability can have
    (above 0, or summing past 1). Which of the two logits modes is told apart the same way."""
    async def top(temperature: float) -> dict[int, float]:
        body = {"prompt": [0], "max_tokens": 1, "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "logprobs": _PROBE_TOP, "return_tokens_as_token_ids": True, "seed": 0}
        try:
            response = await http.post(f"{url}/v1/completions", json=body, timeout=120)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(
                f"{url}: cannot probe the logprobs mode ({type(exc).__name__}: {exc})") from exc
        if not answered(response):
            raise EngineUnavailableError(f"{url}: the logprobs-mode probe answered HTTP {response.status_code}: "
                                         f"{error_message(response)}")
        try:
            entries = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
            return {token_of(key, name="probe token", who=url): float(value) for key, value in entries.items()}
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EngineUnavailableError(f"{url}: the logprobs-mode probe's answer has no top logprobs "
                                         f"({type(exc).__name__}: {exc})") from exc

    greedy, hot = await top(0.0), await top(2.0)
    common = set(greedy) & set(hot)
    changed = max((abs(greedy[t] - hot[t]) for t in common), default=0.0) > _PROBE_TOLERANCE
    values = list(greedy.values())
    if not common:
        raise EngineUnavailableError(f"{url}: the logprobs-mode probe's two answers share no token")
    peak = max(values)
    if peak > _PROBE_TOLERANCE or peak + math.log(sum(math.exp(v - peak) for v in values)) > _PROBE_TOLERANCE:
        return "processed_logits" if changed else "raw_logits"
    return PROCESSED_LOGPROBS if changed else RAW_LOGPROBS
