"""One error tree: every error is a `PipelineError`, drawn in `pipeline.core.errors`; `pipeline`
exports the ones a caller of its public API catches; the command line gives each kind of failure its
own documented exit code."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
from pathlib import Path

import pytest
import redis

import pipeline
from pipeline.cli.main import EXIT_FAILED, EXIT_TIMEOUT, EXIT_UNREACHABLE, EXIT_USAGE, exit_code
from pipeline.core import errors
from schemas.control import WeightAck
from tests.conftest import PIPELINE
from workers import errors as worker_errors

ROOT = Path(__file__).resolve().parents[3]


def _classes(module: object) -> dict[str, type]:
    return {name: obj for name, obj in vars(module).items()
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__}  # type: ignore[attr-defined]


def test_every_error_is_in_the_one_tree_and_pipeline_exports_only_errors_of_it() -> None:
    ours = _classes(errors)
    assert all(issubclass(cls, pipeline.PipelineError) for cls in ours.values())
    assert all(issubclass(cls, pipeline.PipelineError) for cls in _classes(worker_errors).values())
    exported = [name for name in pipeline.__all__ if name.endswith("Error")]
    assert exported and all(getattr(pipeline, name) is ours[name] for name in exported)
    assert issubclass(errors.RedisURLError, ValueError)  # what callers caught before


def test_the_drawn_tree_names_every_class_and_its_real_parent() -> None:
    doc = errors.__doc__ or ""
    drawn = re.findall(r"^ {4}(?:[│ ]*[├└]── )?(?:workers\.errors\.)?([A-Z]\w+)  ", doc, flags=re.M)
    known = {**_classes(errors), **_classes(worker_errors)}
    assert sorted(drawn) == sorted(known)
    for line in doc.splitlines():  # indentation says the parent: the workers branch sits under WorkerError
        match = re.match(r"^ {8}[│ ]{4}[├└]── (\w+)", line)
        if match:
            assert known[match.group(1)].__mro__[1] is worker_errors.WorkerError


def test_the_tree_draws_the_serve_error_in_its_own_package() -> None:
    """`pipeline serve`'s HTTP error lives with the server (HTTP is mapped in `serve/` alone), and is
    drawn in the one tree under its full path."""
    from pipeline.serve.api_error import APIError

    assert issubclass(APIError, errors.PipelineError)
    assert re.search(r"^ {4}├── pipeline\.serve\.api_error\.APIError ", errors.__doc__ or "", flags=re.M)


def test_no_module_defines_an_error_outside_the_tree() -> None:
    allowed = {"pipeline/core/errors.py", "workers/errors.py", "pipeline/serve/api_error.py"}
    # Named in the tree's docstring as outside on purpose.
    outside = {"ControlMessageError", "DecodeError"}
    strays = []
    for package in ("schemas", "pipeline", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.ClassDef) and rel not in allowed and node.name not in outside
                        and re.search(r"(Error|Exception|Violation)$", node.name)):
                    strays.append(f"{rel}:{node.lineno}: {node.name}")
    assert strays == []


def test_exit_codes_tell_failure_timeout_usage_and_unreachable_redis_apart() -> None:
    ack = WeightAck(worker="w1", version=3, ok=False, seconds=0.1, error="no weights")
    assert exit_code(errors.JobsFailedError({"j": "boom"})) == EXIT_FAILED == 1
    assert exit_code(errors.WeightPushError(3, {"w1": "no weights"}, [], [ack])) == EXIT_FAILED
    assert exit_code(errors.WeightPushError(3, {}, ["w2"], [])) == EXIT_TIMEOUT == 3
    assert exit_code(errors.WaitTimeoutError("late")) == EXIT_TIMEOUT
    assert exit_code(redis.ConnectionError("refused")) == EXIT_UNREACHABLE == 4
    assert exit_code(errors.RequestFileError("f", [], 0)) == EXIT_USAGE == 2
    assert exit_code(errors.RedisURLError("bad")) == EXIT_USAGE
    assert len({EXIT_FAILED, EXIT_TIMEOUT, EXIT_UNREACHABLE, EXIT_USAGE}) == 4
    readme = (ROOT / "README.md").read_text()
    for code in (EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_UNREACHABLE):
        assert f"| {code} |" in readme


@pytest.mark.parametrize(("url", "message"), [
    ("http://127.0.0.1:6379", "use redis://, rediss:// (TLS), unix://, redis+sentinel:// or rediss+sentinel://"),
    ("redis+sentinel://x", "no master name after the hosts; expected redis+sentinel://"),
])
def test_a_redis_url_with_an_unknown_scheme_is_one_line(url: str, message: str, pipeline_env: dict[str, str]) -> None:
    result = subprocess.run([*PIPELINE, "status", "--redis", url], env=pipeline_env, capture_output=True, text=True)
    assert result.returncode == EXIT_USAGE
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr


def test_a_wait_that_times_out_exits_with_the_timeout_code(tmp_path: Path, pipeline_env: dict[str, str]) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"id": "a", "input_ids": [1, 2]}\n')
    result = subprocess.run([*PIPELINE, "submit", str(path), "--output", "memory://out", "--wait", "--timeout", "0.3"],
                            env=pipeline_env, capture_output=True, text=True)  # no worker runs
    assert result.returncode == EXIT_TIMEOUT, result.stderr
    assert "0/1 jobs done" in result.stderr and "Traceback" not in result.stderr
