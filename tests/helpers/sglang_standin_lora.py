"""The SGLang stand-in's `--enable-lora`: `/load_lora_adapter`, `/unload_lora_adapter`, `lora_path`.

Shapes and messages follow SGLang 0.5.23 (python/sglang/srt/...): bodies parsed into
`managers/io_struct.py` `LoadLoRAAdapterReqInput` / `UnloadLoRAAdapterReqInput` (422 when they do
not fit); answers `LoRAUpdateOutput` `{"success", "error_message", "loaded_adapters": {name: path}}`,
400 when not a success (`entrypoints/http_server.py`); the checks and texts of
`managers/tokenizer_control_mixin.py` (LoRA not enabled), `lora/lora_manager.py` (already loaded),
`lora/lora_registry.py` (unload of an unknown name) and `managers/tokenizer_manager.py`
`_validate_and_resolve_lora` / `_resolve_lora_path` for `/generate`: a name unloaded before is loaded
again from its path (SGLang's `lora_ref_cache`); a name never loaded answers 400 `{"error":
{"message": "Got LoRA adapter that has never been loaded: ..."}}`.

Stand-in choices, not SGLang's: an adapter is a PEFT directory whose `adapter_config.json` and
`adapter_model.safetensors` must be readable (no tensor is applied); what it changes is the
generation's context: one token, a digest of its weights file, is put before the prompt, so each
adapter version's output differs from the base's and another's, deterministically. The test hook
`forget_loras` (`POST /_standin/faults`) forgets every adapter, as a restart does.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

from tests.helpers.sglang_wheel import parse_body

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoraError(Exception):
    """A refusal: the HTTP status and SGLang's body for it."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


class Loras:
    """The adapters a stand-in serves: name -> (path, the token it puts before prompts)."""

    def __init__(self, enabled: bool, vocab_size: int) -> None:
        self.enabled = enabled
        self.vocab_size = vocab_size
        self.lock = threading.Lock()
        self.registry: dict[str, tuple[str, int]] = {}
        self.ref_cache: dict[str, str] = {}  # every name ever loaded -> its path (SGLang's lora_ref_cache)

    def _update_output(self, success: bool, error: str = "") -> tuple[int, dict[str, Any]]:
        loaded = {name: path for name, (path, _) in self.registry.items()}
        return (200 if success else 400), {"success": success, "error_message": error, "loaded_adapters": loaded}

    def load(self, body: Any) -> tuple[int, dict[str, Any]]:
        request = _parse("LoadLoRAAdapterReqInput", body)
        if not self.enabled:
            return 400, {"success": False, "error_message": NOT_ENABLED, "loaded_adapters": None}
        with self.lock:
            if request.lora_name in self.registry:
                return self._update_output(
                    False, f"Failed to load LoRA adapter {request.lora_name} because it is already loaded")
            try:
                token = _token(Path(request.lora_path), self.vocab_size)
            except OSError as exc:
                return self._update_output(False, f"Failed to load LoRA adapter {request.lora_name}: {exc}")
            self.registry[request.lora_name] = (request.lora_path, token)
            self.ref_cache[request.lora_name] = request.lora_path
            return self._update_output(True)

    def unload(self, body: Any) -> tuple[int, dict[str, Any]]:
        request = _parse("UnloadLoRAAdapterReqInput", body)
        if not self.enabled:
            return 400, {"success": False, "error_message": NOT_ENABLED, "loaded_adapters": None}
        with self.lock:
            if request.lora_name not in self.registry:
                return self._update_output(False, f"LoRA with name {request.lora_name} does not exist. "
                                                  f"Loaded LoRAs: {self.registry.keys()}")
            del self.registry[request.lora_name]
            return self._update_output(True)

    def forget(self) -> None:
        """What a restart does: no adapter loaded, none remembered."""
        with self.lock:
            self.registry.clear()
            self.ref_cache.clear()

    def context(self, lora_path: Any) -> list[int]:
        """The tokens a `/generate` call's `lora_path` puts before its prompt ([] for the base);
        raises `LoraError` as SGLang refuses the call."""
        names = [lora_path] if isinstance(lora_path, str) else list(lora_path or [])
        if not any(names):
            return []
        if not self.enabled:
            first = next(n for n in names if n)
            raise LoraError(400, {"error": {"message": (
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")}})
        with self.lock:
            for name in dict.fromkeys(n for n in names if n):
                if name in self.registry:
                    continue
                if name not in self.ref_cache:
                    raise LoraError(400, {"error": {"message": (
                        f"Got LoRA adapter that has never been loaded: {name}\n"
                        f"All loaded adapters: {self.ref_cache.keys()}.")}})
                path = self.ref_cache[name]  # "Reloading evicted adapter"
                self.registry[name] = (path, _token(Path(path), self.vocab_size))
            return [self.registry[names[0]][1]] if names[0] else []

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {name: path for name, (path, _) in self.registry.items()}


def _parse(class_name: str, body: Any) -> Any:
    try:
        return parse_body(class_name, body)
    except ValueError as exc:
        raise LoraError(422, exc.args[0]) from exc


def _token(directory: Path, vocab_size: int) -> int:
    """The adapter's token: a digest of its weights (its config read too, as SGLang's `LoRAConfig` does)."""
    (directory / CONFIG_FILE).read_text()
    digest = hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).digest()
    return int.from_bytes(digest[:8], "little") % vocab_size
