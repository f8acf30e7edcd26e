"""The installed RQ still has every internal the worker relies on, with the parameters it expects.

An RQ upgrade that renames, removes or re-signs one of them fails here, naming it, instead of
as a hang or a lost job at run time. The worker code reaches RQ's private API only through
`pipeline.core.jobs.rq_seam`.
"""

from __future__ import annotations

import ast
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import fakeredis
import pytest
from rq import SimpleWorker

import workers
from pipeline.core.jobs import rq_seam
from workers.process.engine_worker import EngineWorker
from workers.process.worker import RolloutWorker

WORKERS = Path(workers.__file__).resolve().parent


def _parameters(function: object) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_installed_rq_is_the_pinned_minor() -> None:
    assert version("rq").startswith(rq_seam.RQ_MINOR + "."), (
        f"rq {version('rq')} is installed; pipeline.core.jobs.rq_seam was checked against {rq_seam.RQ_MINOR}.x"
    )
    pyproject = (WORKERS.parent / "pyproject.toml").read_text()
    assert f'"rq=={rq_seam.RQ_MINOR}.*"' in pyproject


@pytest.mark.parametrize("name", sorted({**rq_seam.OVERRIDDEN, **rq_seam.CALLED}))
def test_rq_worker_methods_overridden_or_called_keep_their_parameters(name: str) -> None:
    expected = {**rq_seam.OVERRIDDEN, **rq_seam.CALLED}[name]
    method = getattr(SimpleWorker, name, None)
    assert method is not None, f"rq.SimpleWorker.{name} is gone"
    assert _parameters(method) == expected, f"rq.SimpleWorker.{name} changed its parameters"


@pytest.mark.parametrize("owner,name", sorted(rq_seam.PRIVATE_METHODS, key=lambda key: key[1]))
def test_rq_private_methods_keep_their_parameters(owner: type, name: str) -> None:
    method = getattr(owner, name, None)
    assert method is not None, f"{owner.__name__}.{name} is gone"
    assert _parameters(method) == rq_seam.PRIVATE_METHODS[(owner, name)], f"{owner.__name__}.{name} changed"


def test_rq_workers_still_have_the_private_attributes_read_through_the_seam() -> None:
    worker = SimpleWorker(["q"], connection=fakeredis.FakeRedis())
    missing = [name for name in rq_seam.PRIVATE_ATTRIBUTES if not hasattr(worker, name)]
    assert missing == []
    assert rq_seam.shutdown_requested_at(worker) is None and not rq_seam.stop_requested(worker)
    rq_seam.request_stop(worker)
    assert rq_seam.stop_requested(worker) and rq_seam.stopped_job_id(worker) is None
    assert isinstance(rq_seam.exception_handlers(worker), list)


def test_every_rq_method_the_worker_classes_override_is_listed_in_the_seam() -> None:
    overridden = {
        name
        for cls in (EngineWorker, RolloutWorker)
        for name in vars(cls)
        if not name.startswith("__") and hasattr(SimpleWorker, name)
    }
    assert overridden == set(rq_seam.OVERRIDDEN)
    for name in overridden:  # and each override accepts what RQ passes (its parameters, or passes all on)
        owner = next(cls for cls in (RolloutWorker, EngineWorker) if name in vars(cls))
        parameters = _parameters(getattr(owner, name))
        assert parameters in (rq_seam.OVERRIDDEN[name], ("self", "args", "kwargs")), f"{owner.__name__}.{name}"


def test_no_other_module_touches_rq_private_names() -> None:
    private = {name for _, name in rq_seam.PRIVATE_METHODS} | set(rq_seam.PRIVATE_ATTRIBUTES)
    offenders = []
    for path in sorted(WORKERS.rglob("*.py")):
        if path.name == "rq_seam.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # Attribute uses only: an override's `def _finalize_success` and its super() call are listed above.
            if isinstance(node, ast.Attribute) and node.attr in private and not _is_super_call(node):
                offenders.append(f"{path.relative_to(WORKERS.parent)}:{node.lineno}: .{node.attr}")
    assert offenders == []


def _is_super_call(node: ast.Attribute) -> bool:
    value = node.value
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def test_seam_lists_names_in_rq_form() -> None:
    # A typo in the seam's own tables would make the checks above vacuous.
    assert all(re.fullmatch(r"_[a-z_]+", name) for name in rq_seam.PRIVATE_ATTRIBUTES)
    assert set(rq_seam.OVERRIDDEN).isdisjoint(rq_seam.CALLED)
