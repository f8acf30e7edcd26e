"""The real vLLM server the `vllm-http` tests run against, and the answers recorded from it.

tests/fixtures/vllm/*.json (scripts/record_vllm_fixtures.py) feed the adapter's MockTransport
tests; here every stateless recorded request is sent again to the live server and must get the
recorded answer (same tokens, finish and stop reasons, logprobs within `LOGPROB_TOLERANCE`; same
error status, type and parameter), so the mocks stay true to the vLLM the project runs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.vllm_server import VLLMServer

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "vllm"
# Replayed: answers that depend only on the request (not on the server's weights or a race).
REPLAYED = sorted(p.stem for p in FIXTURES.glob("*.json")
                  if p.stem.startswith(("completion_", "error_"))
                  and p.stem not in ("completion_aborted", "completion_sent_while_paused_v1", "completion_eos_v1"))
# Float32 on the CPU, but a prefix-cache hit computes the prompt's KV in other chunks than a cold
# prefill: the same request may differ in the last digits.
LOGPROB_TOLERANCE = 1e-3

pytestmark = pytest.mark.vllm


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_there_are_recorded_answers_to_replay() -> None:
    assert len(REPLAYED) >= 12, REPLAYED


def test_the_server_runs_the_contract_logprobs_mode_with_dev_endpoints(vllm_server: VLLMServer) -> None:
    info = httpx.get(f"{vllm_server.url}/server_info", params={"config_format": "json"}, timeout=30).json()
    model_config = info["vllm_config"]["model_config"]
    assert model_config["logprobs_mode"] == "processed_logprobs"
    assert model_config["dtype"] == "torch.float32" and model_config["max_logprobs"] == 20
    assert httpx.get(f"{vllm_server.url}/is_paused", timeout=30).json() == {"is_paused": False}


def test_the_vllm_venv_has_the_cpu_torch_and_none_of_the_broken_packages(vllm_server: VLLMServer) -> None:
    probe = ("import importlib.util, torch; "
             "print(torch.__version__, [m for m in ('torchvision', 'torchaudio', 'torchcodec') "
             "if importlib.util.find_spec(m)])")
    out = subprocess.run([str(vllm_server.python), "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2.13.0+cpu", "[]"]


@pytest.mark.parametrize("name", REPLAYED)
def test_a_recorded_answer_is_what_the_server_answers(vllm_server: VLLMServer, name: str) -> None:
    recorded = fixture(name)
    body = dict(recorded["request"]["body"])
    if body["model"] == recorded["server"]["model_path"]:
        body["model"] = str(vllm_server.model_dir)  # recorded on another machine's cache path
    response = httpx.post(f"{vllm_server.url}{recorded['request']['path']}", json=body, timeout=120)
    assert response.status_code == recorded["status"], response.text
    live, then = response.json(), recorded["response"]
    if "error" in then:
        assert {k: live["error"][k] for k in ("type", "param", "code")} == \
               {k: then["error"][k] for k in ("type", "param", "code")}
        return
    assert len(live["choices"]) == len(then["choices"])
    for now, was in zip(live["choices"], then["choices"], strict=True):
        for key in ("index", "text", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids"):
            assert now[key] == was[key], key
        assert now["logprobs"]["tokens"] == was["logprobs"]["tokens"]
        assert now["logprobs"]["token_logprobs"] == pytest.approx(was["logprobs"]["token_logprobs"],
                                                                   abs=LOGPROB_TOLERANCE)
        for top_now, top_was in zip(now["logprobs"]["top_logprobs"], was["logprobs"]["top_logprobs"], strict=True):
            assert top_now.keys() == top_was.keys()
            assert list(top_now.values()) == pytest.approx(list(top_was.values()), abs=LOGPROB_TOLERANCE)
        if was["prompt_logprobs"] is not None:
            assert now["prompt_logprobs"][0] is None
            for pos_now, pos_was in zip(now["prompt_logprobs"][1:], was["prompt_logprobs"][1:], strict=True):
                assert pos_now.keys() == pos_was.keys()
                for token, entry in pos_was.items():
                    assert pos_now[token]["logprob"] == pytest.approx(entry["logprob"], abs=LOGPROB_TOLERANCE)
