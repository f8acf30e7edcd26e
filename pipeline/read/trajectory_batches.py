"""Agent episodes as training batches: `read_trajectories` rows collated into padded torch tensors.

`RolloutBatches(source, trajectories=True)` yields these: per batch of `batch_size` episodes,
`input_ids` [B, T] (right-padded with `pad_id`), `attention_mask`, `loss_mask` (1 exactly on the
sampled tokens: TRL's `env_mask`, verl's `response_mask`), `old_logprobs` (0 elsewhere),
`token_weight_version` and `token_adapter_version` (-1 elsewhere), `reward` [B] (NaN where none was
recorded), and the `session_id`, `lineage`, `adapter` and `turn_starts` of each row as lists: one
row per lineage (a root-to-leaf path of a session's calls, `pipeline.read.trajectories`). A tree
packed into one sequence, each shared token computed once, is `pipeline.read.tree_packing`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import redis
import torch

from pipeline.read.trajectories import read_trajectories


def collate_trajectories(rows: list[dict[str, Any]], *, pad_id: int = 0,
                         pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """One padded batch from `read_trajectories` rows (as `Table.to_pylist()` gives them)."""
    width = max((len(r["input_ids"]) for r in rows), default=0)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    size = (len(rows), width)
    input_ids = np.full(size, pad_id, dtype=np.int64)
    attention = np.zeros(size, dtype=np.int64)
    loss_mask = np.zeros(size, dtype=np.float32)
    old_logprobs = np.zeros(size, dtype=np.float32)
    versions = np.full(size, -1, dtype=np.int64)
    adapter_versions = np.full(size, -1, dtype=np.int64)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[i, :n] = row["input_ids"]
        attention[i, :n] = 1
        loss_mask[i, :n] = row["loss_mask"]
        old_logprobs[i, :n] = row["old_logprobs"]
        versions[i, :n] = row["token_weight_version"]
        adapter_versions[i, :n] = row["token_adapter_version"]
    rewards = np.array([np.nan if r["reward"] is None else r["reward"] for r in rows], dtype=np.float32)
    return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention),
            "loss_mask": torch.from_numpy(loss_mask), "old_logprobs": torch.from_numpy(old_logprobs),
            "token_weight_version": torch.from_numpy(versions),
            "token_adapter_version": torch.from_numpy(adapter_versions), "reward": torch.from_numpy(rewards),
            "session_id": [r["session_id"] for r in rows], "lineage": [r["lineage"] for r in rows],
            "adapter": [r["adapter"] for r in rows], "turn_starts": [r["turn_starts"] for r in rows]}


def trajectory_batches(source: str | pa.Table, *, conn: redis.Redis | None, batch_size: int, pad_id: int,
                       pad_to_multiple_of: int | None, shuffle: bool, seed: int,
                       drop_last: bool) -> Iterator[dict[str, Any]]:
    """The batches `RolloutBatches(..., trajectories=True)` yields."""
    rows = read_trajectories(source, conn=conn).to_pylist()
    if shuffle:
        random.Random(seed).shuffle(rows)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        if len(chunk) < batch_size and drop_last:
            return
        yield collate_trajectories(chunk, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of)
