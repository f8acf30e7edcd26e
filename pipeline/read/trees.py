"""Lineages as a tree: each token stored once, parent pointers.

`token_tree(rows)` takes `read_trajectories` rows (lineages: one session's, an episode group's, any
batch) and merges them into a radix tree: a node is a span of tokens (ids, loss mask, old logprobs,
weight and adapter versions all equal) shared by the same lineages of one adapter (under another
LoRA adapter the same tokens have other states: lineages of two adapters share nothing); its parent
holds the tokens before it.
Lineages of one session share their common calls' tokens by construction (each lineage repeats the
prompt + completion of every call on its path); lineages that start alike (sub-agents under one
system prompt, the n episodes of one task) share their common leading tokens too. Both are exact to
compute once: under causal attention a token's state depends only on the tokens before it, and
those are the same. `read_trees(source)` is one tree per session of `read_trajectories(source)`.

A tree's `lineage(i)` gives lineage `i`'s tokens back (its path's spans end to end), equal to its row;
`pipeline.read.tree_packing` packs a tree into one training sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pyarrow as pa
import redis

FIELDS = ("input_ids", "loss_mask", "old_logprobs", "token_weight_version", "token_adapter_version")
_DTYPES = {"input_ids": np.int32, "loss_mask": np.int8, "old_logprobs": np.float32, "token_weight_version": np.int64,
           "token_adapter_version": np.int64}


@dataclass(frozen=True)
class TreeNode:
    """A span of tokens: `parent` (index of the node holding the tokens before it, -1 for a root),
    `position` (its first token's position in each of its lineages) and the five per-token arrays."""

    parent: int
    position: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    old_logprobs: np.ndarray
    token_weight_version: np.ndarray
    token_adapter_version: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TokenTree:
    """Nodes (parents before children), the node each lineage ends at (`leaves`, -1 for an empty one)
    and each lineage's row fields other than its tokens (`lineages`: session_id, lineage, reward...)."""

    nodes: list[TreeNode]
    leaves: list[int]
    lineages: list[dict[str, Any]]

    @property
    def tokens(self) -> int:
        """Tokens stored: each shared token once."""
        return sum(len(node) for node in self.nodes)

    def path(self, lineage: int) -> list[int]:
        """The nodes of lineage `lineage`, root first."""
        out = []
        node = self.leaves[lineage]
        while node >= 0:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def lineage(self, lineage: int) -> dict[str, np.ndarray]:
        """Lineage `lineage`'s per-token arrays, as its row has them."""
        path = [self.nodes[n] for n in self.path(lineage)]
        return {name: np.concatenate([getattr(n, name) for n in path] or [np.zeros(0, _DTYPES[name])])
                for name in FIELDS}


@dataclass
class _Building:
    parent: _Building | None
    arrays: dict[str, np.ndarray]
    children: dict[tuple[Any, ...], _Building] = field(default_factory=dict)
    ends: list[int] = field(default_factory=list)  # the lineages ending with this node's last token

    def key(self, index: int = 0) -> tuple[Any, ...]:
        return _key(self.arrays, index)

    def split(self, at: int) -> None:
        """Keep the first `at` tokens; the rest become this node's one child (with its children and ends)."""
        tail = _Building(self, {k: v[at:] for k, v in self.arrays.items()}, self.children, self.ends)
        for child in tail.children.values():
            child.parent = tail
        self.arrays = {k: v[:at] for k, v in self.arrays.items()}
        self.children, self.ends = {tail.key(): tail}, []


def _key(arrays: dict[str, np.ndarray], index: int) -> tuple[Any, ...]:
    return tuple(arrays[name][index].tobytes() for name in FIELDS)


def _common(a: dict[str, np.ndarray], b: dict[str, np.ndarray], offset: int) -> int:
    """How many leading tokens of `a` equal `b`'s from `offset` on (logprobs compared bit for bit)."""
    n = min(len(a["input_ids"]), len(b["input_ids"]) - offset)
    equal = np.ones(n, dtype=bool)
    for name in FIELDS:
        left, right = a[name][:n], b[name][offset:offset + n]
        if name == "old_logprobs":
            left, right = left.view(np.int32), right.view(np.int32)
        equal &= left == right
    return n if equal.all() else int(np.argmin(equal))


def token_tree(rows: Sequence[dict[str, Any]] | pa.Table) -> TokenTree:
    """The radix tree of `read_trajectories` rows (see the module docstring); lineage i is row i."""
    items = rows.to_pylist() if isinstance(rows, pa.Table) else list(rows)
    roots: dict[str | None, _Building] = {}  # one per adapter: lineages of two adapters share no token
    for index, item in enumerate(items):
        arrays = {name: np.asarray(item.get(name, [-1] * len(item["input_ids"])) if name == "token_adapter_version"
                                   else item[name], dtype=_DTYPES[name]) for name in FIELDS}
        node = roots.setdefault(item.get("adapter"), _Building(None, {}))
        pos, length = 0, len(arrays["input_ids"])
        while pos < length:
            child = node.children.get(_key(arrays, pos))
            if child is None:
                child = _Building(node, {k: v[pos:] for k, v in arrays.items()})
                node.children[child.key()] = child
                node, pos = child, length
                break
            shared = _common(child.arrays, arrays, pos)
            if shared < len(child.arrays["input_ids"]):
                child.split(shared)
            node, pos = child, pos + shared
        node.ends.append(index)
    nodes: list[TreeNode] = []
    leaves = [-1] * len(items)
    stack: list[tuple[_Building, int, int]] = [(c, -1, 0) for root in reversed(roots.values())
                                               for c in reversed(root.children.values())]
    while stack:  # depth first, parents before children
        building, parent, position = stack.pop()
        nodes.append(TreeNode(parent, position, **building.arrays))
        me = len(nodes) - 1
        for lineage in building.ends:
            leaves[lineage] = me
        after = position + len(building.arrays["input_ids"])
        stack.extend((c, me, after) for c in reversed(building.children.values()))
    meta = [{k: v for k, v in item.items() if k not in FIELDS} for item in items]
    return TokenTree(nodes, leaves, meta)


def read_trees(source: str | pa.Table, *, conn: redis.Redis | None = None,
               rewards: dict[str, dict[str, Any] | None] | None = None) -> list[TokenTree]:
    """One tree per session of `read_trajectories(source, conn=conn, rewards=rewards)`, in its order."""
    from pipeline.read.trajectories import read_trajectories

    table = cast(pa.Table, read_trajectories(source, conn=conn, rewards=rewards))  # groups=False: one table
    sessions: dict[str, list[dict[str, Any]]] = {}
    for item in table.to_pylist():
        sessions.setdefault(item["session_id"], []).append(item)
    return [token_tree(items) for items in sessions.values()]
