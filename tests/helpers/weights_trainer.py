"""A trainer for the weight-store tests: a model in memory taking real optimizer steps, and a bit-for-bit comparison."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pipeline.core.weights.manifest import Manifest, TensorEntry
from pipeline.core.weights.store import version_dir


class Trainer:
    """A model in memory taking real optimizer steps (a backward pass on a batch, AdamW)."""

    def __init__(self, model_dir: Path) -> None:
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-2)

    def step(self) -> None:
        ids = torch.randint(1, 70, (4, 16))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def save(self, path: Path) -> str:
        """The test's reference for teacher forcing (the push itself never writes a checkpoint)."""
        self.model.save_pretrained(path)
        return str(path)


def same_bits(engine_tensors: dict[str, torch.Tensor], trainer_tensors: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same names and every tensor's bits are equal."""
    return engine_tensors.keys() == trainer_tensors.keys() and all(
        torch.equal(engine_tensors[n].view(torch.int32), t.view(torch.int32)) for n, t in trainer_tensors.items())


def corrupt_a_delta(store_dir: Path, manifest: Manifest) -> TensorEntry:
    """Zero one encoded tensor's bytes of a delta version on disk (a damaged store); that tensor's entry."""
    entry = next(t for t in manifest.tensors if t.encoding in ("xor", "sparse"))
    blob_file = store_dir / version_dir(manifest.version) / str(entry.file)
    data = bytearray(blob_file.read_bytes())
    data[entry.offset:entry.offset + entry.length] = b"\0" * entry.length
    blob_file.write_bytes(bytes(data))
    return entry
