"""Engine options from the command line: the SGLang adapters' routed-experts layout and vocabulary."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.commands.worker_options import engine_options
from workers.engines.factory import EngineOptions, _sglang_model_facts
from workers.engines.sglang.expert_ids import ExpertsLayout
from workers.errors import EngineUnavailableError


def test_layout_and_vocabulary_come_from_the_model_config(tiny_moe_dir: Path) -> None:
    facts = _sglang_model_facts(EngineOptions(engine="sglang-http", model=str(tiny_moe_dir), routed_experts=True))
    layout = facts["experts_layout"]
    assert isinstance(layout, ExpertsLayout) and (layout.layers, layout.top_k, layout.num_experts) == (2, 2, 8)
    assert facts["routed_experts"] is True and facts["vocab_size"] == 72


def test_explicit_layout_and_clear_errors(tiny_model_dir: Path) -> None:
    facts = _sglang_model_facts(EngineOptions(engine="sglang-http", routed_experts=True, experts_layout="48,8,128"))
    assert facts["experts_layout"] == ExpertsLayout(layers=48, top_k=8, num_experts=128)
    with pytest.raises(EngineUnavailableError, match="needs the layout"):
        _sglang_model_facts(EngineOptions(engine="sglang-http", model=str(tiny_model_dir), routed_experts=True))
    with pytest.raises(EngineUnavailableError, match="LAYERS,TOP_K,EXPERTS"):
        _sglang_model_facts(EngineOptions(engine="sglang-http", routed_experts=True, experts_layout="48x8"))
    # Without --routed-experts a dense model still gives the vocabulary for submit-time checks.
    assert _sglang_model_facts(EngineOptions(engine="sglang-http", model=str(tiny_model_dir))) == {
        "routed_experts": False, "vocab_size": 72}


def test_cli_flags_reach_the_options() -> None:
    from pipeline.cli.main import build_parser

    args = build_parser().parse_args(["worker", "--engine", "sglang-http", "--url", "http://a:1", "--url",
                                      "http://b:2", "--routed-experts", "--experts-layout", "4,2,16"])
    options = engine_options(args)
    assert options.urls == ("http://a:1", "http://b:2") and options.routed_experts
    assert options.experts_layout == "4,2,16"


def test_worker_model_takes_the_demo_names_as_every_command_does(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`pipeline worker --model demo` (or `demo-perturbed`) is the demo model's directory, as for
    `--tokenizer`, `verify --model` and `weights push`; one not converted yet says how to make it."""
    from pipeline.cli.main import build_parser
    from pipeline.core.demo_model import demo_dir
    from pipeline.core.errors import PipelineError

    monkeypatch.setenv("PIPELINE_MODEL_CACHE", str(tmp_path))
    parse = build_parser().parse_args
    with pytest.raises(PipelineError, match="run `pipeline demo`"):
        engine_options(parse(["worker", "--model", "demo"]))
    for name in ("demo", "demo-perturbed"):
        demo_dir(name).mkdir(parents=True)
        (demo_dir(name) / "config.json").write_text("{}")
        assert engine_options(parse(["worker", "--model", name])).model == str(demo_dir(name))
    assert engine_options(parse(["worker", "--model", str(tmp_path)])).model == str(tmp_path)
