"""A session's calls as a tree, from the parent pointers the server wrote, and its lineages.

Every row of an agent turn names the call it extends (`parent_turn`, `parent_sample`: the call and
sample whose prompt + completion its prompt starts with; null for a root). A lineage is a
root-to-leaf path: a leaf is a call no other call names as parent and gives its sample 0; each
call on the path gives the sample its child names. Lineages come in the order of their leaf's
turn. The tree is built from the pointers alone; each edge used is checked (the child's prompt
starts with its parent's prompt + completion) and a broken one is an error naming the session and
the calls: the server placed a call where its tokens do not fit.

A lineage is one policy's: a call that ran on another LoRA adapter than the call it extends (a
call's `model` names its adapter) starts a lineage of its own, the earlier calls' tokens its prompt
(sampled by another policy: not its to train on), and does not end its parent's lineage.

A turn logged twice (a worker died after logging it and its retry logged it again) counts once:
its latest row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import PipelineError

Row = dict[str, Any]


@dataclass(frozen=True)
class Lineage:
    """One root-to-leaf path of a session's calls: `calls` (rows, root first, one sample each) and
    `parent_turn`, the parent call of its first call not on an earlier lineage (None when the lineage
    starts at a root of its own)."""

    calls: list[Row]
    parent_turn: int | None

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter every call of the lineage ran on (None: the base weights)."""
        return self.calls[0].get("adapter")

    @property
    def leaf(self) -> Row:
        return self.calls[-1]


def _parent(row: Row) -> tuple[int, int] | None:
    if row.get("parent_turn") is None:
        return None
    return int(row["parent_turn"]), int(row.get("parent_sample") or 0)


def _latest(rows: list[Row]) -> dict[int, dict[int, Row]]:
    """turn → sample → row, a turn logged twice counting once (its latest row)."""
    by_turn: dict[int, dict[int, Row]] = {}
    for row in sorted(rows, key=lambda r: r["finished_at"]):
        by_turn.setdefault(int(row["turn"]), {})[int(row["sample_index"])] = row
    return by_turn


def _check_edge(session_id: str, child: Row, parent: Row) -> None:
    turn, parent_turn = child["turn"], parent["turn"]
    if parent_turn >= turn:
        raise PipelineError(f"session {session_id!r}: call {turn} names call {parent_turn} as its parent, which did "
                            "not start before it; the server's parent pointers are inconsistent (a server bug: report "
                            "it with the session's rows, `pipeline.read.lineage_rows.turn_rows`)")
    head = parent["prompt_token_ids"] + parent["completion_token_ids"]
    if child["prompt_token_ids"][: len(head)] != head:
        raise PipelineError(f"session {session_id!r}: call {turn}'s prompt does not start with the prompt + completion "
                            f"of its parent, call {parent_turn} sample {parent['sample_index']}; the server placed it "
                            "wrongly (a server bug: report it with the session's rows, "
                            "`pipeline.read.lineage_rows.turn_rows`)")


def _same_policy(parent: Row, child: Row) -> bool:
    return parent.get("adapter") == child.get("adapter")


def lineages(session_id: str, rows: list[Row]) -> list[Lineage]:
    """The session's lineages, by leaf turn (see the module docstring)."""
    by_turn = _latest(rows)
    named: set[int] = set()
    for turn, samples in by_turn.items():
        parent = _parent(next(iter(samples.values())))
        if parent is None:
            continue
        parent_turn, parent_sample = parent
        parent_row = by_turn.get(parent_turn, {}).get(parent_sample)
        if parent_row is None:
            raise PipelineError(f"session {session_id!r}: call {turn} names call {parent_turn} sample {parent_sample} "
                                "as its parent, which has no rows; the session's rows are incomplete (read a run by "
                                "name to include its turn log) or the server's pointers are wrong")
        for row in samples.values():
            _check_edge(session_id, row, parent_row)
        if _same_policy(parent_row, next(iter(samples.values()))):
            named.add(parent_turn)
    out: list[Lineage] = []
    covered: set[tuple[int, int]] = set()
    for leaf in sorted(set(by_turn) - named):
        samples = by_turn[leaf]
        path = [samples[min(samples)]]
        cut = None  # the call of another adapter the lineage's root extends
        while (parent := _parent(path[-1])) is not None:
            above = by_turn[parent[0]][parent[1]]
            if not _same_policy(above, path[-1]):
                cut = parent[0]
                break
            path.append(above)
        path.reverse()
        nodes = [(int(r["turn"]), int(r["sample_index"])) for r in path]
        first_new = next(i for i, node in enumerate(nodes) if node not in covered)
        out.append(Lineage(path, cut if first_new == 0 else nodes[first_new - 1][0]))
        covered.update(nodes)
    return out
