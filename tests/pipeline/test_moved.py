"""Module paths of the releases before the regroup keep importing, to the modules where they live now."""

from __future__ import annotations

import importlib
import sys

import pytest

import pipeline
from pipeline.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_the_module_where_it_lives_now(old: str) -> None:
    sys.modules.pop(old, None)  # imported by an earlier test: import it afresh
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_names_of_the_public_api_keep_their_meaning() -> None:
    from pipeline.take import rewards_differ  # noqa: F401 - README code of earlier releases imports it so
    from pipeline.torch_data import RolloutBatches  # noqa: F401

    assert callable(pipeline.verify) and callable(pipeline.report) and callable(pipeline.routed_experts)
    assert pipeline.connect is pipeline.client.connect
