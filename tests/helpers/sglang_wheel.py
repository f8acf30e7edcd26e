"""SGLang's own request classes, loaded from its wheel without SGLang's GPU dependencies.

`import sglang` needs the whole serving stack (triton, a CUDA torchvision, zmq, ...), so the
package `__init__`s are skipped: bare parent packages point into the wheel (a zip, read by
zipimport) and only these modules run, from SGLang's own source:

- `sglang.api.v1.api_types` (msgspec only): `GenerateRequest.from_json_value`, the `/generate`
  JSON contract gate of `srt/entrypoints/api_contract.py` (types, unknown fields);
- `sglang.srt.sampling.sampling_params`: `SamplingParams(**params)`, `.normalize`, `.verify`;
- `sglang.srt.managers.io_struct`: `GenerateReqInput(**body).normalize_batch_and_arguments()`;
- `sglang.srt.parser.jinja_template_utils`: `detect_jinja_template_content_format` (chat goldens).
  It imports the scheduler (`managers.schedule_batch`), the multimodal helpers and zmq for
  other request classes; those few names are stubbed (`_STUBS`), and the stubs refuse what
  they do not model (hidden states, multimodal data), so a request that would need them fails
  loudly instead of passing.

The wheel is found at `$SGLANG_WHEEL`, else `.venv/wheels/sglang-*.whl` (`make install`
downloads it with `pip download --no-deps`).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import json
import os
import sys
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SGLANG_VERSION = "0.5.23"
# Top-level fields the smg gateway adds when it forwards a /generate body (SGLang ignores them).
GATEWAY_FIELDS = frozenset({"model"})


class WheelMissing(RuntimeError):
    pass


def wheel_path() -> Path:
    explicit = os.environ.get("SGLANG_WHEEL")
    if explicit:
        return Path(explicit)
    found = sorted((REPO / ".venv" / "wheels").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        raise WheelMissing(
            f"SGLang's wheel is not in {REPO / '.venv' / 'wheels'}: run `make install`, or "
            f"`pip download --no-deps sglang=={SGLANG_VERSION} -d .venv/wheels`, or set $SGLANG_WHEEL"
        )
    return found[-1]


def _bare_package(name: str, wheel: Path) -> None:
    """A package whose `__init__` is not run: submodules load from the wheel."""
    if name in sys.modules:
        return
    module = types.ModuleType(name)
    module.__path__ = [f"{wheel}/{name.replace('.', '/')}"]
    sys.modules[name] = module


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"the SGLang stand-in does not model {what}")
    return refuse


def _has_valid_data(data: Any) -> bool:
    if data is None or data == [] or data == [None]:
        return False
    raise ValueError("the SGLang stand-in does not model multimodal data")


def _return_hidden_states_mode(mode: Any) -> None:
    if mode is False or mode is None:
        return None
    raise ValueError("the SGLang stand-in does not model return_hidden_states")


class _Placeholder:
    """A name other request classes use (only in annotations for ours): any value validates."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


# Modules io_struct imports for the scheduler, multimodal inputs and transport: stand-ins for
# the names it takes from them.
_STUBS: dict[str, dict[str, Any]] = {
    "zmq": {}, "zmq.asyncio": {},
    "sglang.srt.managers.schedule_batch": {
        "Modality": enum.Enum("Modality", "IMAGE VIDEO AUDIO"), "MultimodalProcessorOutput": _Placeholder,
        "ReturnHiddenStatesMode": Any, "SamplingLogprobsMode": Any,
        "get_return_hidden_states_mode": _return_hidden_states_mode,
    },
    "sglang.srt.multimodal.mm_utils": {"has_valid_data": _has_valid_data},
    "sglang.srt.utils": {"ImageData": _Placeholder, "VideoData": _Placeholder, "ConcurrentCounter": _Placeholder,
                         "flatten_nested_list": _refuse("nested multimodal lists"), "GLM_MEDIA_CONFIG_KEYS": ()},
    "sglang.srt.utils.cuda_ipc_transport_utils": {"CudaIpcTensorTransportProxy": _Placeholder},
}


@cache
def load() -> types.SimpleNamespace:
    """The three SGLang modules, loaded once per process."""
    wheel = wheel_path()
    if not zipfile.is_zipfile(wheel):
        raise WheelMissing(f"{wheel} is not a wheel (zip) file")
    for name in ("sglang", "sglang.api", "sglang.srt", "sglang.srt.sampling", "sglang.srt.managers",
                 "sglang.srt.lora", "sglang.srt.beam_search", "sglang.srt.multimodal", "sglang.srt.parser"):
        _bare_package(name, wheel)
    for name, attributes in _STUBS.items():
        if name in sys.modules and not name.startswith("sglang"):
            continue  # a real zmq, if installed, serves as well
        module = types.ModuleType(name)
        if name == "sglang.srt.utils":
            module.__path__ = [f"{wheel}/sglang/srt/utils"]  # its submodules are real
        module.__dict__.update(attributes)
        sys.modules[name] = module
    return types.SimpleNamespace(
        api_types=importlib.import_module("sglang.api.v1.api_types"),
        sampling_params=importlib.import_module("sglang.srt.sampling.sampling_params"),
        io_struct=importlib.import_module("sglang.srt.managers.io_struct"),
    )


def jinja_content_format(chat_template: str) -> str:
    """SGLang's own `detect_jinja_template_content_format` ('string' or 'openai'), from
    `srt/parser/jinja_template_utils.py` (it needs jinja2 and transformers, nothing of the GPU stack)."""
    load()
    module = importlib.import_module("sglang.srt.parser.jinja_template_utils")
    return module.detect_jinja_template_content_format(chat_template)


@cache
def request_adapter() -> Any:
    """FastAPI's parse of a `/generate` body: pydantic over the `GenerateReqInput` dataclass."""
    import pydantic

    return pydantic.TypeAdapter(load().io_struct.GenerateReqInput)


@dataclass(frozen=True)
class Verdict:
    """What SGLang's HTTP server does with a `/generate` body: the per-sample sampling params and
    rids it would run with, or the HTTP status and (SGLang-shaped) body it would answer."""

    status: int
    error: Any = None
    sampling: tuple[Any, ...] = ()
    rids: tuple[str, ...] = ()


def judge_generate(body: Any, vocab_size: int, tokenizer: Any = None) -> Verdict:
    """`/generate` as SGLang 0.5.23's Python server admits it: FastAPI's parse of the
    `GenerateReqInput` dataclass (422), the contract gate `api_contract.generate_contract_error`
    (400 `{"error": text}`), `normalize_batch_and_arguments`, then `tokenizer_manager`'s
    `SamplingParams(**p)`, `.normalize(tokenizer)`, `.verify(vocab_size)` (400 `{"error": {"message"}}`).

    One deliberate difference: SGLang ignores unknown top-level fields silently; this refuses
    them (400), so an adapter's misspelt field cannot pass unnoticed (except `GATEWAY_FIELDS`)."""
    import pydantic

    sgl = load()
    try:
        obj = request_adapter().validate_python(body)
    except pydantic.ValidationError as exc:
        return Verdict(422, {"detail": json.loads(exc.json(include_url=False))})
    known = {f.name for f in dataclasses.fields(sgl.io_struct.GenerateReqInput)} | GATEWAY_FIELDS
    unknown = sorted(set(body) - known)
    if unknown:
        return Verdict(400, {"error": {"message": f"unknown field(s) {unknown}: SGLang {SGLANG_VERSION} would "
                                                  "ignore them silently (the stand-in refuses them)"}})
    try:
        sgl.api_types.GenerateRequest.from_json_value(body)
    except sgl.api_types.JsonContractError as exc:
        return Verdict(400, {"error": str(exc)})
    try:
        obj.normalize_batch_and_arguments()
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        sampling = []
        for p in params:
            sp = sgl.sampling_params.SamplingParams(**(p or {}))
            sp.normalize(tokenizer)
            sp.verify(vocab_size)
            sampling.append(sp)
    except (ValueError, TypeError) as exc:
        return Verdict(400, {"error": {"message": str(exc)}})
    rids = obj.rid if isinstance(obj.rid, list) else [obj.rid]
    return Verdict(200, sampling=tuple(sampling), rids=tuple(rids))


def parse_body(class_name: str, body: Any) -> Any:
    """FastAPI's parse of a body into SGLang's `io_struct.<class_name>` (`LoadLoRAAdapterReqInput`,
    `UnloadLoRAAdapterReqInput`); `ValueError` carrying the 422 `{"detail"}` body when it does not fit."""
    import pydantic

    try:
        return pydantic.TypeAdapter(getattr(load().io_struct, class_name)).validate_python(body)
    except pydantic.ValidationError as exc:
        raise ValueError({"detail": json.loads(exc.json(include_url=False))}) from exc


def engine_method_parameters(method: str) -> list[str]:
    """The parameter names of `sglang.Engine.<method>`, read from the wheel's source
    (`srt/entrypoints/engine.py`; importing it needs the GPU stack)."""
    with zipfile.ZipFile(wheel_path()) as wheel:
        source = wheel.read("sglang/srt/entrypoints/engine.py").decode()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "Engine":
            for item in node.body:
                if isinstance(item, ast.AsyncFunctionDef | ast.FunctionDef) and item.name == method:
                    args = item.args
                    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if a.arg != "self"]
    raise LookupError(f"Engine.{method} not found in sglang/srt/entrypoints/engine.py")
