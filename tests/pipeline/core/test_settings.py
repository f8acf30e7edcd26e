"""`pipeline.core.settings` is the one reader of the environment, and docs/configuration.md lists what it declares.

No module of `pipeline`, `workers` or `schemas` but `pipeline/core/settings.py` touches `os.environ`
or `os.getenv`, reading or writing (a child process's environment, should one be needed, is to
be built by an accessor there too). The one exception is `schemas/request.py`, which reads the
request size limits (`schemas.request.LIMITS`, listed by `pipeline.core.settings`): `schemas` imports
nothing from `pipeline`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipeline.core import settings

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("pipeline", "workers", "schemas")
READERS = {"pipeline/core/settings.py", "schemas/request.py"}
_OS_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_uses(source: str) -> list[int]:
    """Lines of `source` that touch the process environment through `os`."""
    tree = ast.parse(source)
    aliases = {"os"}
    found: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {alias.asname or alias.name for alias in node.names if alias.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [node.lineno for alias in node.names if alias.name in _OS_NAMES]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _OS_NAMES and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            found.append(node.lineno)
    return sorted(found)


def test_the_scan_sees_each_way_of_reading() -> None:
    source = ("import os\nimport os as o\nfrom os import environ\nos.environ.get('A')\no.getenv('B')\n"
              "os.environ['C']\nenviron.get('D')\nos.path.join('a')\n")
    assert environment_uses(source) == [3, 4, 5, 6]


def test_no_module_but_settings_reads_the_environment() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name not in READERS:
                offenders += [f"{name}:{line}" for line in environment_uses(path.read_text())]
    assert offenders == [], f"read the environment through pipeline.core.settings instead: {offenders}"


def _documented() -> list[str]:
    """The variables of docs/configuration.md's tables (first column)."""
    names = []
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`([A-Z][A-Z0-9_]*)`", line.split("|")[1])
    return names


def test_the_documentation_lists_exactly_the_declared_variables() -> None:
    documented = _documented()
    assert len(documented) == len(set(documented)), "a variable is documented twice"
    assert set(documented) == set(settings.VARIABLES), (
        f"documented, not declared: {sorted(set(documented) - set(settings.VARIABLES))}; "
        f"declared, not documented: {sorted(set(settings.VARIABLES) - set(documented))}"
    )


def test_every_declaration_is_complete() -> None:
    for name, variable in settings.VARIABLES.items():
        assert variable.name == name and variable.meaning and isinstance(variable.type, type), name
    from schemas.request import LIMITS

    assert set(LIMITS) <= set(settings.VARIABLES)


def test_values_are_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PIPELINE_MAX_HANDBACKS", "PIPELINE_REDIS_RECONNECT_S", "PIPELINE_ALLOWED_OUTPUT_SCHEMES"):
        monkeypatch.delenv(name, raising=False)
    assert settings.max_handbacks() == 5 and settings.redis_reconnect_s() == 60.0
    assert settings.allowed_output_schemes() == []
    monkeypatch.setenv("PIPELINE_MAX_HANDBACKS", "2")
    monkeypatch.setenv("PIPELINE_REDIS_RECONNECT_S", "1.5")
    monkeypatch.setenv("PIPELINE_ALLOWED_OUTPUT_SCHEMES", " s3, ,file ")
    assert settings.max_handbacks() == 2 and settings.redis_reconnect_s() == 1.5
    assert settings.allowed_output_schemes() == ["s3", "file"]


def test_bad_values_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", "all")
    with pytest.raises(ValueError, match=r"PIPELINE_REDIS_WAIT_REPLICAS='all': use auto"):
        settings.redis_wait_replicas()
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_REPLICAS", " AUTO ")
    assert settings.redis_wait_replicas() is None
    monkeypatch.setenv("PIPELINE_REDIS_WAIT_TIMEOUT_MS", "0")
    with pytest.raises(ValueError, match=r"PIPELINE_REDIS_WAIT_TIMEOUT_MS='0'"):
        settings.redis_wait_timeout_ms()
    monkeypatch.setenv("PIPELINE_METRICS_PORT", "http")
    with pytest.raises(ValueError, match=r"\$PIPELINE_METRICS_PORT must be a port number, not 'http'"):
        settings.metrics_port()
    monkeypatch.setenv("PIPELINE_MAX_HANDBACKS", "many")
    with pytest.raises(ValueError):
        settings.max_handbacks()


def test_paths_follow_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("PIPELINE_HOME", "PIPELINE_MODEL_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert settings.home() == tmp_path / "state" / "rollout-pipeline"
    assert settings.model_cache() == tmp_path / "cache" / "rollout-pipeline" / "models"
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    assert settings.home() == tmp_path / "home"
