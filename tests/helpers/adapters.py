"""Tiny PEFT LoRA adapters on the tiny models of `tests.helpers.models`, and an independent
recomputation of greedy decoding under base + adapter (peft's own model, no cache, one sequence)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def lora_model(base_dir: Path, *, seed: int, rank: int = 4, targets: Sequence[str] = ("q_proj", "v_proj")) -> Any:
    """The base model wrapped by peft with a random LoRA adapter (B not zero, so it changes outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(4.0)
    return peft_model


def build_adapter(base_dir: Path, path: Path, *, seed: int, **kwargs: Any) -> Path:
    """A PEFT adapter directory (`save_pretrained`: adapter_config.json + adapter_model.safetensors)."""
    lora_model(base_dir, seed=seed, **kwargs).save_pretrained(path)
    return path


def greedy_reference(base_dir: Path, adapter_dir: Path | None, prompt: Sequence[int], tokens: int) -> list[int]:
    """Greedy tokens of `prompt` under the base model plus the adapter in `adapter_dir` (None: the base),
    recomputed by peft's model over the whole sequence at each step (no KV cache, no batch)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
    return out


def push_racing(client: Any, name: str, dirs: Sequence[Path], base: Path) -> list[Any]:
    """Push every adapter directory of `dirs` as adapter `name` at once, one thread each; their results."""
    import threading

    results: list[Any] = []
    threads = [threading.Thread(target=lambda d=d: results.append(client.push_adapter(name, d, base=base)))
               for d in dirs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
