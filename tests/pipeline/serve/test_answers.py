"""A turn's rows as the server reads them: every sample, in sample order, each with its own prompt ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.serve.answers import ANSWER_COLUMNS, turn_rows


def _table(samples: list[int], prompts: list[list[int]]) -> pa.Table:
    columns: dict[str, Any] = {name: [None] * len(samples) for name in ANSWER_COLUMNS}
    columns["sample_index"] = samples
    columns["prompt_token_ids"] = pa.array(prompts, type=pa.list_(pa.int32()))
    return pa.table(columns)


def test_each_row_has_its_own_prompt_ids_in_sample_order_across_chunks_and_slices() -> None:
    whole = _table([2, 0], [[7, 8, 9], [1, 2]])
    table = pa.concat_tables([_table([5], [[4]]).slice(0, 0), whole.slice(1, 1), whole.slice(0, 1),
                              _table([9, 1], [[6], [3, 3, 3, 3]]).slice(1, 1)])
    rows = turn_rows(table)
    assert [r["sample_index"] for r in rows] == [0, 1, 2]
    assert [r["prompt_token_ids"].tolist() for r in rows] == [[1, 2], [3, 3, 3, 3], [7, 8, 9]]
    assert all(r["prompt_token_ids"].dtype == np.int32 for r in rows)
