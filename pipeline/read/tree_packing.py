"""A tree of lineages packed into one training sequence: each shared token computed once.

`pack_tree(tree)` lays a `pipeline.read.trees.TokenTree` out depth first, each node's tokens once,
with what makes one forward pass over it equal to a forward pass over each lineage alone:

- `position_ids`: each token's position in its own lineage (a node's tokens continue its parent's);
- `attention`: [N, N] bool, True where token i attends token j: exactly its ancestors, the earlier
  tokens of its node and every token of its ancestor nodes (`attention_bias` gives the 4D additive
  float mask transformers takes as `attention_mask`, returned to the attention kernels as is, eager
  and sdpa alike);
- `previous`: for each token, the token before it in its lineage (-1 for a root's first token), so
  the logprob of token i is read from the logits at `previous[i]` (`token_logprobs`);
- `loss_mask`, `old_logprobs`, `token_weight_version`, `token_adapter_version`: the lineages' own,
  aligned (a token is shared only where all of them agree);
- `lineage_positions[l]`: the packed positions of lineage l's tokens in order, so
  `input_ids[lineage_positions[l]]` is its row's `input_ids`, and a per-lineage loss (its reward, its
  advantage) is a gather away: a shared token's gradient gets every lineage's share, as if each
  lineage had been trained alone.

    from pipeline.read.tree_packing import collate_tree, lineage_logprobs, pack_tree
    from pipeline.read.trees import read_trees

    for tree in read_trees("agents"):
        batch = collate_tree(pack_tree(tree), dtype=model.dtype)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        for lineage, logprobs in enumerate(lineage_logprobs(logits, batch)):
            ...  # logprobs[t]: token t of the lineage given tokens < t, as the lineage run alone

The mask is dense (N² entries): a tree of 16 k tokens takes 1 GiB as float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.core.errors import PipelineError
from pipeline.read.trees import TokenTree


@dataclass(frozen=True)
class PackedTree:
    """One tree as one sequence of N tokens (see the module docstring)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    attention: np.ndarray
    previous: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    token_weight_version: np.ndarray
    token_adapter_version: np.ndarray
    lineage_positions: list[np.ndarray]
    lineages: list[dict[str, Any]]

    def attention_bias(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[1, 1, N, N]: 0 where a token attends, the dtype's lowest value where it does not."""
        allowed = torch.from_numpy(self.attention)
        bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return bias[None, None]


def pack_tree(tree: TokenTree) -> PackedTree:
    """`tree` as one sequence (nodes in the tree's order: parents before children). One forward pass
    runs one LoRA adapter (or the base), so a tree whose lineages ran on several is refused."""
    adapters = {lineage.get("adapter") for lineage in tree.lineages}
    if len(adapters) > 1:
        raise PipelineError(f"the tree's lineages ran on {len(adapters)} adapters ({sorted(adapters, key=str)}); "
                            "one forward pass runs one: pack each adapter's lineages on their own")
    starts = np.cumsum([0] + [len(node) for node in tree.nodes])
    size = int(starts[-1])
    attention = np.zeros((size, size), dtype=bool)
    previous = np.full(size, -1, dtype=np.int64)
    positions = np.zeros(size, dtype=np.int64)
    for index, node in enumerate(tree.nodes):
        start, end = int(starts[index]), int(starts[index + 1])
        positions[start:end] = node.position + np.arange(end - start)
        attention[start:end, start:end] = np.tril(np.ones((end - start, end - start), dtype=bool))
        if node.parent >= 0:
            attention[start:end] |= attention[int(starts[node.parent + 1]) - 1]  # the parent's last token's view
            previous[start] = starts[node.parent + 1] - 1
        previous[start + 1:end] = np.arange(start, end - 1)

    def column(name: str) -> np.ndarray:
        parts = [getattr(node, name) for node in tree.nodes]
        return np.concatenate(parts) if parts else np.zeros(0)

    lineage_positions = [np.concatenate([np.arange(starts[n], starts[n + 1]) for n in tree.path(lineage)]
                                        or [np.zeros(0, dtype=np.int64)]).astype(np.int64)
                         for lineage in range(len(tree.leaves))]
    return PackedTree(column("input_ids").astype(np.int64), positions, attention, previous, column("loss_mask"),
                      column("old_logprobs"), column("token_weight_version"), column("token_adapter_version"),
                      lineage_positions, tree.lineages)


def collate_tree(packed: PackedTree, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A batch of one packed tree: `input_ids`, `position_ids` [1, N], `attention_mask` [1, 1, N, N]
    (additive, `dtype`), `loss_mask`, `old_logprobs`, `token_weight_version`, `token_adapter_version`
    [1, N], `previous` [N], `lineage_positions` (a LongTensor per lineage) and `reward` [L] (NaN where
    none was recorded)."""
    rewards = [np.nan if r.get("reward") is None else r["reward"] for r in packed.lineages]
    return {"input_ids": torch.from_numpy(packed.input_ids)[None],
            "position_ids": torch.from_numpy(packed.position_ids)[None],
            "attention_mask": packed.attention_bias(dtype),
            "loss_mask": torch.from_numpy(packed.loss_mask.astype(np.float32))[None],
            "old_logprobs": torch.from_numpy(packed.old_logprobs.astype(np.float32))[None],
            "token_weight_version": torch.from_numpy(packed.token_weight_version.astype(np.int64))[None],
            "token_adapter_version": torch.from_numpy(packed.token_adapter_version.astype(np.int64))[None],
            "previous": torch.from_numpy(packed.previous),
            "lineage_positions": [torch.from_numpy(p) for p in packed.lineage_positions],
            "reward": torch.tensor(rewards, dtype=torch.float32)}


def token_logprobs(logits: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """[N]: each packed token's logprob given the tokens before it in its lineage (0 for a root's first)."""
    flat = logits.reshape(-1, logits.shape[-1])
    logprobs = torch.log_softmax(flat.to(torch.promote_types(flat.dtype, torch.float32)), dim=-1)
    previous, ids = batch["previous"], batch["input_ids"].reshape(-1)
    picked = logprobs[previous.clamp(min=0), ids]
    return torch.where(previous >= 0, picked, torch.zeros_like(picked))


def lineage_logprobs(logits: torch.Tensor, batch: dict[str, Any]) -> list[torch.Tensor]:
    """Per lineage, its tokens' logprobs in order (`token_logprobs` gathered at its positions)."""
    packed = token_logprobs(logits, batch)
    return [packed[positions] for positions in batch["lineage_positions"]]
