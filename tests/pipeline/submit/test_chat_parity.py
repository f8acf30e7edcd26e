"""Chat rendering matches SGLang's: every recorded case of tests/fixtures/parity/*.json, tokens checked.

The fixtures are recorded by scripts/record_parity_fixtures.py from the reference path. A case
marked `known_gap` is reported (a warning) while the pipeline differs, and fails once it matches,
so that the marker gets removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pipeline.submit.render import ChatRenderer, RenderError
from pipeline.submit.request_file import validation_errors

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PARITY_FILES = sorted((FIXTURES / "parity").glob("*.json"))


def _cases() -> list[Any]:
    params = []
    for path in PARITY_FILES:
        fixture = json.loads(path.read_text())
        for case in fixture["cases"]:
            params.append(pytest.param(fixture["tokenizer"], case, id=f"{fixture['tokenizer']}-{case['name']}"))
    return params


@pytest.fixture(scope="module")
def renderers() -> dict[str, ChatRenderer]:
    return {path.stem: ChatRenderer(FIXTURES / "tokenizers" / path.stem) for path in PARITY_FILES}


def _sha(ids: list[int]) -> str:
    return hashlib.sha256(",".join(str(i) for i in ids).encode()).hexdigest()


def _outcome(renderer: ChatRenderer, request: dict[str, Any]) -> dict[str, Any]:
    try:
        line = renderer.render_line(json.dumps(request))
    except RenderError as exc:
        return {"error": {"field": exc.field, "message": exc.message}}
    except ValidationError as exc:
        first = validation_errors("<case>", 1, exc)[0]
        return {"error": {"field": first.field, "message": first.message}}
    assert isinstance(line, dict)
    ids = line["input_ids"]
    return {"prompt_text": line["prompt_text"], "token_count": len(ids), "token_sha256": _sha(ids), "token_ids": ids}


def _matches(case: dict[str, Any], outcome: dict[str, Any]) -> tuple[bool, str]:
    if "expected_error" in case:
        want = case["expected_error"]
        got = outcome.get("error")
        if got is None:
            return False, f"expected rejection ({want}), got {outcome['token_count']} tokens"
        ok = got["field"].startswith(want["field"]) and want["contains"] in got["message"]
        return ok, f"expected {want}, got {got}"
    want = case["expected"]
    if "error" in outcome:
        return False, f"expected {want['token_count']} tokens, got rejection {outcome['error']}"
    for key in ("prompt_text", "token_count", "token_sha256"):
        if outcome[key] != want[key]:
            return False, f"{key}: expected {want[key]!r}, got {outcome[key]!r}"
    return True, ""


def test_every_case_is_checked() -> None:
    assert {p.stem for p in PARITY_FILES} >= {"smollm2", "tiny-tools"}
    for path in PARITY_FILES:
        for case in json.loads(path.read_text())["cases"]:
            assert ("expected" in case) != ("expected_error" in case), case["name"]
            if "expected" in case:
                expected = case["expected"]
                assert expected["token_count"] == len(expected["token_ids"]) > 0
                assert expected["token_sha256"] == _sha(expected["token_ids"])


@pytest.mark.parametrize(("tokenizer", "case"), _cases())
def test_parity(renderers: dict[str, ChatRenderer], tokenizer: str, case: dict[str, Any]) -> None:
    outcome = _outcome(renderers[tokenizer], case["request"])
    ok, why = _matches(case, outcome)
    if "known_gap" in case:
        assert not ok, f"{case['name']} now matches the reference: remove its known_gap marker"
        warnings.warn(f"known gap {tokenizer}/{case['name']}: {case['known_gap']} ({why})", stacklevel=1)
        return
    assert ok, f"{case['rule']}: {why}"


def test_the_goldens_come_from_the_independent_recorder_alone(tmp_path: Path) -> None:
    """Re-recording gives the committed fixtures, without importing anything of `pipeline`."""
    root = Path(__file__).resolve().parents[3]
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['record', '--output', {str(tmp_path)!r}]\n"
        "try:\n"
        "    runpy.run_path('scripts/record_parity_fixtures.py', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "loaded = sorted(m for m in sys.modules if m == 'pipeline' or m.startswith('pipeline.'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                   stdout=subprocess.DEVNULL)
    for path in PARITY_FILES:
        assert json.loads((tmp_path / path.name).read_text()) == json.loads(path.read_text()), path.name

