"""The committed JSON Schema files must match the models (regenerate: `make schemas`)."""

from __future__ import annotations

import pytest

from schemas.generate import MODELS, SCHEMA_DIR, render


@pytest.mark.parametrize("name", sorted(MODELS))
def test_schema_file_matches_model(name: str) -> None:
    path = SCHEMA_DIR / name
    assert path.exists(), f"{path} missing: run `make schemas`"
    assert path.read_text() == render(MODELS[name]), f"{path} drifted from the model: run `make schemas`"
