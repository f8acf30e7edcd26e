"""Submitting datasets: each input kind, the column mapping and its errors, all-or-nothing on a bad
row in the last row group, chat columns rendered as chat lines are, a verl-format Parquet file.

Jobs go to the session's real redis-server and are read back as a worker reads them
(`JobPayload.unpack` of the job data and its staged prompt ids).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

import pipeline
from pipeline.cli.main import main as cli_main
from pipeline.core.broker import keys
from pipeline.core.errors import ColumnMappingError, DatasetError
from pipeline.core.jobs.queue import rollout_queue
from pipeline.submit.render import ChatRenderer
from schemas.chat import ChatRequest
from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest

TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizers" / "tiny-tools"
OUT = "memory://datasets"


def _queued(conn: redis.Redis) -> list[RolloutRequest]:
    """Every queued request, in job order, as a worker would read it."""
    out: list[RolloutRequest] = []
    for job_id in rollout_queue(conn).job_ids:
        payload = JobPayload.model_validate(Job.fetch(job_id, connection=conn, serializer=JSONSerializer).args[0])
        out.extend(payload.unpack(conn.get(payload.prompt_key) if payload.prompt_key else None))
    return out


def _nothing_enqueued(conn: redis.Redis) -> None:
    assert rollout_queue(conn).count == 0
    assert conn.keys(keys.prompts("*")) == []


def _table(rows: int = 10) -> pa.Table:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, size=int(rng.integers(1, 20))).tolist() for _ in range(rows)]
    return pa.table({
        "prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
        "temp": pa.array([0.5 if i % 2 else None for i in range(rows)], pa.float64()),
        "reward_model": pa.array([{"ground_truth": f"answer-{i}", "style": "rule"} for i in range(rows)]),
    })


_MAPPING = {"columns": {"input_ids": "prompt_ids", "temperature": "temp"},
            "metadata": {"answer": "reward_model.ground_truth"}, "sampling": {"max_new_tokens": 16, "n": 2}}


def _expect(table: pa.Table) -> list[dict[str, Any]]:
    return [{"id": str(i), "input_ids": row["prompt_ids"], "temperature": row["temp"] or 1.0, "n": 2,
             "max_new_tokens": 16, "metadata": {"answer": row["reward_model"]["ground_truth"]}}
            for i, row in enumerate(table.to_pylist())]


def _got(requests: list[RolloutRequest]) -> list[dict[str, Any]]:
    return [{"id": r.id, "input_ids": r.input_ids, "temperature": r.sampling_params.temperature,
             "n": r.sampling_params.n, "max_new_tokens": r.sampling_params.max_new_tokens, "metadata": r.metadata}
            for r in requests]


def _write(kind: str, table: pa.Table, tmp_path: Path) -> Any:
    if kind == "parquet":
        pq.write_table(table, tmp_path / "d.parquet", row_group_size=3)
        return str(tmp_path / "d.parquet")
    if kind == "parquet-directory":
        (tmp_path / "parts" / "b").mkdir(parents=True)
        pq.write_table(table.slice(0, 4), tmp_path / "parts" / "a.parquet")
        pq.write_table(table.slice(4), tmp_path / "parts" / "b" / "c.parquet")
        return str(tmp_path / "parts")
    if kind == "arrow-file":
        with pa.ipc.new_file(tmp_path / "d.arrow", table.schema) as writer:
            for batch in table.to_batches(max_chunksize=4):
                writer.write_batch(batch)
        return str(tmp_path / "d.arrow")
    if kind == "arrow-stream":
        with pa.ipc.new_stream(tmp_path / "s.arrow", table.schema) as writer:
            writer.write_table(table, max_chunksize=4)
        return str(tmp_path / "s.arrow")
    if kind == "feather":
        feather.write_feather(table, tmp_path / "d.feather")
        return str(tmp_path / "d.feather")
    if kind == "save_to_disk":
        import datasets

        datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"))
        return str(tmp_path / "saved")
    if kind == "table":
        return table
    if kind == "pandas":
        return table.to_pandas()
    assert kind == "datasets"
    import datasets

    return datasets.Dataset(table)


KINDS = ["parquet", "parquet-directory", "arrow-file", "arrow-stream", "feather", "save_to_disk", "table", "pandas",
         "datasets"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_input_kind_submits_every_row_as_mapped(kind: str, redis_url: str, redis_client: redis.Redis,
                                                     tmp_path: Path) -> None:
    table = _table()
    source = _write(kind, table, tmp_path)
    client = pipeline.connect(redis_url)
    if isinstance(source, str):
        batch = client.submit_file(source, output=OUT, batch_size=4, **_MAPPING)
    else:
        batch = client.submit(source, output=OUT, batch_size=4, **_MAPPING)
    assert batch.plan.requests == 10 and batch.plan.samples == 20 and len(batch.plan.job_ids) == 3
    assert _got(_queued(redis_client)) == _expect(table)


def test_a_shuffled_datasets_dataset_submits_its_rows_in_its_own_order(redis_url: str,
                                                                       redis_client: redis.Redis) -> None:
    import datasets

    table = _table()
    shuffled = datasets.Dataset(table).select([7, 2, 9])
    pipeline.connect(redis_url).submit(shuffled, output=OUT, **_MAPPING)
    got = _queued(redis_client)
    assert [r.input_ids for r in got] == [table.column("prompt_ids")[i].as_py() for i in (7, 2, 9)]
    assert [r.id for r in got] == ["0", "1", "2"]  # ids count the rows submitted


def test_cli_submits_parquet_with_mapping_and_sampling_flags(redis_url: str, redis_client: redis.Redis,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    table = _table().append_column("uid", pa.array([f"q{i}" for i in range(10)]))
    pq.write_table(table, tmp_path / "d.parquet")
    code = cli_main(["submit", str(tmp_path / "d.parquet"), "--redis", redis_url, "--output", OUT,
                     "--column", "input_ids=prompt_ids", "--column", "id=uid", "--column", "temperature=temp",
                     "--metadata", "answer=reward_model.ground_truth", "--max-new-tokens", "16", "--n", "2",
                     "--stop", "###", "--stop", "END", "--seed", "7"])
    assert code == 0, capsys.readouterr().err
    assert "requests: 10 (20 samples)" in capsys.readouterr().out
    got = _queued(redis_client)
    assert [r.id for r in got] == [f"q{i}" for i in range(10)]
    assert _got(got) == [{**e, "id": f"q{i}"} for i, e in enumerate(_expect(table))]
    assert all(r.sampling_params.stop == ["###", "END"] and r.sampling_params.seed == 7 for r in got)


def test_columns_named_like_fields_need_no_mapping(redis_url: str, redis_client: redis.Redis) -> None:
    table = pa.table({"input_ids": [[1, 2], [3]], "id": ["a", "b"], "max_new_tokens": [5, 6],
                      "sampling_params": [{"temperature": 0.0}, {"temperature": 0.7}], "metadata": [{"k": 1}, None]})
    pipeline.connect(redis_url).submit(table, output=OUT)
    got = _queued(redis_client)
    assert [(r.id, r.input_ids, r.sampling_params.temperature, r.metadata) for r in got] == [
        ("a", [1, 2], 0.0, {"k": 1}), ("b", [3], 0.7, {})]
    # a column named like a sampling parameter is taken only when mapped
    assert [r.sampling_params.max_new_tokens for r in got] == [128, 128]


@pytest.mark.parametrize(("mapping", "table", "message"), [
    ({"columns": {"input_ids": "nope"}}, {"prompt_ids": [[1]]}, "input_ids: the dataset has no column 'nope'"),
    ({"metadata": {"answer": "rm.truth"}}, {"input_ids": [[1]], "rm": [{"gt": "x"}]},
     "metadata.answer: the dataset has no column 'rm.truth'"),
    ({"columns": {"input_ids": "p"}}, {"p": [["a"]]}, "column 'p' is list<item: string>; prompt ids need a list"),
    ({"columns": {"input_idz": "p"}}, {"p": [[1]]}, "'input_idz' is not a request field"),
    ({}, {"p": [[1]]}, "found no input_ids, messages or prompt column"),
    ({"columns": {"messages": "m"}}, {"input_ids": [[1]], "m": ["x"]}, "found columns for input_ids and messages"),
    ({"columns": {"messages": "m"}}, {"m": [[{"role": "user", "content": "x"}]]}, "needs a tokenizer"),
    ({"sampling": {"temperature": -1.0}}, {"input_ids": [[1]]}, "default sampling parameters: temperature"),
    ({"metadata": {"when": "t"}}, {"input_ids": [[1]], "t": pa.array([0], pa.timestamp("s"))},
     "metadata.when: column 't' is timestamp[s]; metadata must be plain JSON"),
    ({}, {"input_ids": [[1]], "metadata": [{"raw": b"x"}]}, "metadata: column 'metadata' is struct<raw: binary>"),
])
def test_mapping_errors_name_the_column_and_enqueue_nothing(mapping: dict[str, Any], table: dict[str, Any],
                                                            message: str, redis_url: str,
                                                            redis_client: redis.Redis) -> None:
    with pytest.raises(ColumnMappingError, match=None) as caught:
        pipeline.connect(redis_url).submit(pa.table(table), output=OUT, **mapping)
    assert message in str(caught.value)
    _nothing_enqueued(redis_client)


def test_cli_mapping_syntax_and_jsonl_are_refused(redis_url: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pq.write_table(pa.table({"input_ids": [[1]]}), tmp_path / "d.parquet")
    assert cli_main(["submit", str(tmp_path / "d.parquet"), "--redis", redis_url, "--column", "input_ids"]) == 2
    assert "write NAME=COLUMN" in capsys.readouterr().err
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    assert cli_main(["submit", str(tmp_path / "r.jsonl"), "--redis", redis_url, "--metadata", "k=c"]) == 2
    assert "apply to a dataset" in capsys.readouterr().err


def test_a_bad_row_in_the_middle_of_the_last_row_group_enqueues_nothing(redis_url: str, redis_client: redis.Redis,
                                                                        tmp_path: Path) -> None:
    rows = 50_000  # several record batches and row groups, staged to Redis before the bad row is read
    prompts = np.arange(rows * 4, dtype=np.int32) % 1000
    prompts[(rows - 5_000) * 4 + 2] = -3  # row 45 000: in the last row group (40 000..49 999), mid-group
    ids = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 4 + 1, 4, dtype=np.int32)), pa.array(prompts))
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "big.parquet", row_group_size=10_000)
    assert pq.ParquetFile(tmp_path / "big.parquet").metadata.num_row_groups == 5
    with pytest.raises(DatasetError) as caught:
        pipeline.connect(redis_url).submit_file(str(tmp_path / "big.parquet"), output=OUT)
    assert [(e.row, e.column) for e in caught.value.errors] == [(45_000, "input_ids")]
    assert "row 45000: column 'input_ids': token id -3 is negative" in str(caught.value)
    _nothing_enqueued(redis_client)


def test_row_errors_name_row_and_column_at_most_twenty(redis_url: str, redis_client: redis.Redis) -> None:
    rows = 30
    table = pa.table({"p": [[1, 2]] * rows, "temp": [-1.0] * 25 + [0.5] * 5,
                      "uid": ["x"] * 27 + ["y", "y", "z"]})
    with pytest.raises(DatasetError) as caught:
        pipeline.connect(redis_url).submit(table, output=OUT, columns={"input_ids": "p", "temperature": "temp",
                                                                       "id": "uid"}, vocab_size=2)
    error = caught.value  # each row's ids are checked first, as a column: every row fails there
    assert error.count == 30 and len(error.errors) == 20
    assert [(e.row, e.column) for e in error.errors] == [(row, "p") for row in range(20)]
    assert "30 problem(s) in 30 rows" in str(error) and "... and 10 more" in str(error)
    _nothing_enqueued(redis_client)
    table = table.set_column(0, "p", pa.array([[1, 1]] * rows))
    with pytest.raises(DatasetError) as caught:
        pipeline.connect(redis_url).submit(table, output=OUT, columns={"input_ids": "p", "temperature": "temp",
                                                                       "id": "uid"}, vocab_size=2)
    error = caught.value
    assert error.count == 25 + 2  # temperatures of rows 0-24; ids 'x' (row 26 after 25) and 'y' (28 after 27)
    first = error.errors[0]
    assert (first.row, first.column) == (0, "temp") and "sampling_params.temperature" in first.message
    with pytest.raises(DatasetError) as caught:
        pipeline.connect(redis_url).submit(table.slice(20), output=OUT, vocab_size=2,
                                           columns={"input_ids": "p", "temperature": "temp", "id": "uid"})
    assert [(e.row, e.column, e.message.split(" (")[0]) for e in caught.value.errors] == [
        *((row, "temp", "sampling_params.temperature: Input should be greater than or equal to 0") for row in range(5)),
        (6, "uid", "duplicate id 'x'"), (8, "uid", "duplicate id 'y'")]
    _nothing_enqueued(redis_client)


def _verl_table() -> pa.Table:
    questions = ["What is 2+3?", "Name a prime.", "Say hi."]
    return pa.table({
        "data_source": ["openai/gsm8k"] * 3,
        "prompt": [[{"role": "system", "content": "Think step by step."}, {"role": "user", "content": q}]
                   for q in questions],
        "ability": ["math"] * 3,
        "reward_model": [{"style": "rule", "ground_truth": g} for g in ("5", "7", "hi")],
        "extra_info": [{"split": "train", "index": i} for i in (10, 11, 12)],
    })


def test_verl_parquet_recipe_renders_chat_columns_as_chat_lines(redis_url: str, redis_client: redis.Redis,
                                                                tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    table = _verl_table()
    pq.write_table(table, tmp_path / "train.parquet")
    code = cli_main(["submit", str(tmp_path / "train.parquet"), "--redis", redis_url, "--output", OUT,
                     "--tokenizer", str(TOKENIZER), "--column", "messages=prompt", "--column", "id=extra_info.index",
                     "--metadata", "answer=reward_model.ground_truth", "--metadata", "data_source=data_source",
                     "--max-new-tokens", "64", "--n", "4"])
    assert code == 0, capsys.readouterr().err
    renderer = ChatRenderer(TOKENIZER)
    got = _queued(redis_client)
    assert [r.id for r in got] == ["10", "11", "12"]
    for request, row in zip(got, table.to_pylist(), strict=True):
        line = renderer.render_line({"id": "x", "messages": row["prompt"]})  # what a JSONL chat line gets
        assert request.input_ids == line["input_ids"] and request.prompt_text == line["prompt_text"]
        assert request.metadata == {"answer": row["reward_model"]["ground_truth"], "data_source": "openai/gsm8k"}
        assert (request.sampling_params.n, request.sampling_params.max_new_tokens) == (4, 64)


def test_chat_column_errors_name_the_row_and_column(redis_url: str, redis_client: redis.Redis) -> None:
    table = pa.table({"conv": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}], [], None],
                      "text": [None, None, None, "plain text prompt"]})
    with pytest.raises(DatasetError) as caught:
        pipeline.connect(redis_url).submit(table, output=OUT, tokenizer=TOKENIZER, columns={"messages": "conv"})
    assert [(e.row, e.column) for e in caught.value.errors] == [(1, "conv"), (2, "conv"), (3, "conv")]
    assert "a user message needs content" in caught.value.errors[0].message
    assert "Messages cannot be empty" in caught.value.errors[1].message
    _nothing_enqueued(redis_client)
    batch = pipeline.connect(redis_url).submit(table.slice(3), output=OUT, tokenizer=TOKENIZER,
                                               columns={"prompt": "text"})
    assert batch.plan.requests == 1
    request = _queued(redis_client)[0]
    assert request.prompt_text == "plain text prompt"
    expected = ChatRenderer(TOKENIZER).render(ChatRequest(id="x", prompt="plain text prompt"))
    assert request.input_ids == expected.input_ids


def _plain_table(rows: int) -> pa.Table:
    return pa.table({
        "input_ids": pa.array([[i % 7 + 1] * (i % 5 + 1) for i in range(rows)], pa.list_(pa.int64())),
        "uid": pa.array([1000 + i for i in range(rows)], pa.int64()),
        "group_seed": pa.array([i // 2 for i in range(rows)], pa.int64()),
        "score": pa.array([i / 4 if i % 3 else None for i in range(rows)], pa.float64()),
        "tag": pa.array([f"t{i}" if i % 4 else None for i in range(rows)]),
    })


_PLAIN = {"columns": {"id": "uid", "seed": "group_seed"}, "metadata": {"score": "score", "tag": "tag"},
          "sampling": {"max_new_tokens": 9, "stop": ["\n"]}}


@pytest.mark.parametrize("batch_size", [3, 4, 64])
def test_the_columnar_path_packs_the_jobs_the_per_row_path_packs(batch_size: int, redis_url: str,
                                                                  redis_client: redis.Redis,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.submit.dataset_source.BATCH_ROWS", 4)  # jobs span record batches
    table = _plain_table(10)
    client = pipeline.connect(redis_url)
    columnar = client.submit(table, output=OUT, batch_size=batch_size, **_PLAIN)
    by_column = _queued(redis_client)
    redis_client.flushall()
    # A `logprobs` column (all 0, the default) sends every row through the per-row path.
    per_row = client.submit(table.append_column("lp", pa.array([0] * 10)), output=OUT, batch_size=batch_size,
                            **{**_PLAIN, "columns": {**_PLAIN["columns"], "logprobs": "lp"}})
    assert _queued(redis_client) == by_column
    assert len(columnar.plan.job_ids) == len(per_row.plan.job_ids) == -(-10 // batch_size)
    assert [r.id for r in by_column] == [str(1000 + i) for i in range(10)]
    assert [r.sampling_params.seed for r in by_column] == [i // 2 for i in range(10)]
    assert by_column[1].metadata == {"score": 0.25, "tag": "t1"} and by_column[0].metadata == {"score": None,
                                                                                                "tag": None}
    assert all(r.sampling_params.stop == ["\n"] and r.sampling_params.max_new_tokens == 9 for r in by_column)


@pytest.mark.parametrize(("change", "expected"), [
    (("uid", pa.array([1000 + i for i in range(9)] + [1004], pa.int64())), (9, "uid", "duplicate id '1004'")),
    (("score", pa.array([0.5] * 7 + [float("nan")] + [0.5] * 2)), (7, "score", "metadata: metadata must be plain")),
    (("group_seed", pa.array([1] * 5 + [-2] + [1] * 4, pa.int64())), (5, "group_seed", "sampling_params.seed")),
    (("uid", pa.array(["x" * (600 if i == 6 else 3) + str(i) for i in range(10)])), (6, "uid", "id: String should")),
])
def test_row_problems_found_by_column_are_worded_per_row(change: tuple[str, pa.Array], expected: tuple[int, str, str],
                                                        redis_url: str, redis_client: redis.Redis,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pipeline.submit.dataset_source.BATCH_ROWS", 4)
    table = _plain_table(10)
    table = table.set_column(table.schema.get_field_index(change[0]), change[0], change[1])
    with pytest.raises(DatasetError) as caught:
        pipeline.connect(redis_url).submit(table, output=OUT, **_PLAIN)
    assert [(e.row, e.column) for e in caught.value.errors] == [expected[:2]]
    assert caught.value.errors[0].message.startswith(expected[2]), caught.value.errors[0].message
    _nothing_enqueued(redis_client)


def test_a_mapping_for_request_dicts_or_jsonl_is_refused(redis_url: str, redis_client: redis.Redis,
                                                          tmp_path: Path) -> None:
    client = pipeline.connect(redis_url)
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    with pytest.raises(pipeline.PipelineError, match="applies to datasets"):
        client.submit_file(str(tmp_path / "r.jsonl"), columns={"input_ids": "x"})
    with pytest.raises(pipeline.PipelineError, match="map the columns of a table"):
        client.submit([{"id": "a", "input_ids": [1]}], sampling={"n": 2})
    _nothing_enqueued(redis_client)


@pytest.mark.parametrize("kind", [pa.list_(pa.int16()), pa.large_list(pa.int64()), pa.list_(pa.uint32(), 3)])
def test_prompt_ids_of_every_integer_list_type_and_a_sliced_table(kind: pa.DataType, redis_url: str,
                                                                  redis_client: redis.Redis) -> None:
    prompts = [[i, i + 1, i + 2] for i in range(8)]
    table = pa.table({"input_ids": pa.array(prompts, kind)}).slice(3, 4)  # offsets not starting at 0
    pipeline.connect(redis_url).submit(table, output=OUT)
    assert [(r.id, r.input_ids) for r in _queued(redis_client)] == [(str(i), prompts[3 + i]) for i in range(4)]
