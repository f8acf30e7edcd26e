"""`pipeline report`: a self-contained HTML page of a real run, parsed back and checked."""

from __future__ import annotations

import base64
import html
import io
import shutil
import subprocess
from collections import Counter
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from matplotlib import image

import pipeline
from pipeline.core.broker import commit_log, keys
from pipeline.serve.sessions import Pending, Placed, SessionStore, TurnRecord
from schemas.job_payload import TurnTag
from schemas.request import RolloutRequest
from schemas.shard import SHARD_SCHEMA, rows_to_ipc
from tests.conftest import PIPELINE
from tests.workers.audit.test_verify import make_swap_run
from workers.engines.base import Finish, SampleOutput
from workers.rows.shard_writer import write_shard
from workers.rows.table import RowContext, build_table


class Page(HTMLParser):
    """Every image source, link target, section title and table of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.images: list[str] = []
        self.links: list[str] = []
        self.titles: list[str] = []
        self.tables: list[list[list[str]]] = []
        self._in: str | None = None
        self._row: list[str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "img":
            self.images.append(values.get("src") or "")
        if tag in ("link", "script", "a") and (values.get("href") or values.get("src")):
            self.links.append(values.get("href") or values.get("src") or "")
        if tag == "table":
            self.tables.append([])
        if tag == "tr":
            self._row = []
        if tag in ("td", "th", "h2"):
            self._in = tag
            if tag != "h2" and self._row is not None:
                self._row.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None
        if tag in ("td", "th", "h2"):
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "h2":
            self.titles.append(data)
        elif self._in in ("td", "th") and self._row is not None:
            self._row[-1] += data

    def table_with(self, column: str) -> list[dict[str, str]]:
        """The rows of the first table with this column."""
        for table in self.tables:
            if table and column in table[0]:
                return [dict(zip(table[0], row, strict=True)) for row in table[1:]]
        raise AssertionError(f"no table with a column {column!r}")


def assert_self_contained(page: Page) -> None:
    assert page.images and not page.links
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        pixels = image.imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
        assert pixels.shape[0] > 50 and pixels.shape[1] > 50 and pixels.std() > 0  # a drawn plot, not a blank


def test_report_of_a_run_shows_its_numbers(dense_run: str, tiny_model_dir: Path, tmp_path: Path,
                                          pipeline_env: dict[str, str]) -> None:
    out = tmp_path / "report.html"
    done = subprocess.run([*PIPELINE, "report", "dense", "--out", str(out), "--verify-model", str(tiny_model_dir)],
                          env=pipeline_env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    page = Page(out.read_text())
    assert_self_contained(page)
    assert len(page.images) == 6  # lengths, finishes, logprobs, workers, throughput, verify (no staleness plot)
    assert page.titles[:5] == ["Completion length per weight version", "Finish and stop reasons",
                               "Logprobs and entropy proxy", "Rows and tokens per worker", "Throughput over time"]
    rows = pipeline.read_rollouts(dense_run).to_pylist()
    (overview,) = page.table_with("completion tokens")
    assert overview["rows"] == str(len(rows))
    assert overview["completion tokens"] == str(sum(r["completion_tokens"] for r in rows))
    finishes = Counter(r["finish_reason"] for r in rows)
    shown = Counter()
    for line in page.table_with("finish_reason"):
        shown[line["finish_reason"]] += int(line["rows"])
    assert shown == finishes
    (verify,) = page.table_with("weight_version")
    assert float(verify["max_abs_diff"]) <= 1e-3 and verify["tokens"] == overview["completion tokens"]
    (throughput,) = page.table_with("tokens/s while generating")
    assert throughput["completion tokens"] == overview["completion tokens"]
    assert float(throughput["generating (s)"]) <= float(throughput["span (s)"])


CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(__file__).resolve().parents[3] / "build" / "test-artifacts"
# Appended to a copy of the page: once loaded, the count of images and of broken ones.
PROBE = ("<script>window.addEventListener('load',()=>{const all=[...document.images];"
         "document.body.setAttribute('data-images',all.length+'/'+all.filter(i=>!(i.complete&&i.naturalWidth>0))"
         ".length)})</script>")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_in_a_real_browser(dense_run: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Headless chromium loads every image with no console message; the screenshot is kept in
    build/test-artifacts/report.png."""
    assert CHROMIUM is not None
    page = pipeline.report(dense_run, verify_model=str(tiny_model_dir))
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=5000"]
    dom = subprocess.run([*flags, "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr
    images = len(Page(page).images)
    assert f'data-images="{images}/0"' in dom.stdout  # every image decoded, none broken
    assert "CONSOLE" not in dom.stderr, dom.stderr  # no console message: no error, no warning
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    report_file = tmp_path / "report.html"
    report_file.write_text(page)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    done = subprocess.run([*flags, "--window-size=1280,3600", f"--screenshot={shot}", report_file.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.exists(), done.stderr
    pixels = image.imread(shot)
    assert pixels.shape[:2] == (3600, 1280) and pixels.std() > 0


def test_report_shows_staleness_of_a_partial_swap(redis_client: redis.Redis, tmp_path: Path, tiny_model_dir: Path,
                                                  v1_model_dir: Path) -> None:
    url = make_swap_run(redis_client, tmp_path, tiny_model_dir, v1_model_dir)
    rows = pipeline.read_rollouts(url).to_pylist()
    behind = sum(r["weight_version_segments"][1]["start"] for r in rows)  # v0 tokens, 1 version behind v1
    page = Page(pipeline.report(url))
    assert_self_contained(page)
    assert "Staleness (weight-version lag)" in page.titles
    lags = {line["lag"]: int(line["tokens"]) for line in page.table_with("lag")}
    assert lags == {"0": 120 - behind, "1": behind}


def test_an_empty_location_is_refused(tmp_path: Path) -> None:
    with pytest.raises(pipeline.NoShardsError):
        pipeline.report(str(tmp_path))
    pq.write_table(SHARD_SCHEMA.empty_table(), tmp_path / "empty.parquet")  # a shard without rows
    with pytest.raises(pipeline.PipelineError, match="no rows under"):
        pipeline.report(str(tmp_path))


def timed_shard(out: Path, job_id: str, tokens: int, started: float, finished: float) -> None:
    """A one-row shard through the workers' row builder whose job ran from `started` to `finished` (epoch s)."""
    request = RolloutRequest.model_validate({"id": job_id, "input_ids": [1, 2], "logprobs": 0,
                                             "sampling_params": {"max_new_tokens": tokens}})
    output = SampleOutput(token_ids=np.arange(1, tokens + 1, dtype=np.int32), finish=Finish("length"),
                          logprobs=np.full(tokens, -1.0, np.float32))
    at = [datetime.fromtimestamp(t, UTC) for t in (started, started, finished)]
    ctx = RowContext(run="timed", job_id=job_id, engine="sim", model="m", worker_id="w", weight_version=0,
                     submitted_at=at[0], started_at=at[1], finished_at=at[2])
    write_shard(build_table([request], [[output]], ctx), f"file://{out}", "timed", job_id)


def test_throughput_comes_from_the_rows_start_and_finish_times(tmp_path: Path) -> None:
    """Two jobs of 10 s each, 100 s apart (a trainer's step between them): 200 tokens over 20 s of
    generation (10 tokens/s) and a 110 s span; no commit time or floor comes into it."""
    t0 = 1_700_000_000.0
    timed_shard(tmp_path, "j1", 100, t0, t0 + 10)
    timed_shard(tmp_path, "j2", 100, t0 + 100, t0 + 110)
    text = pipeline.report(str(tmp_path / "timed"))
    (throughput,) = Page(text).table_with("tokens/s while generating")
    assert (throughput["span (s)"], throughput["generating (s)"]) == ("110.0", "20.0")
    assert throughput["completion tokens"] == "200"
    assert float(throughput["tokens/s while generating"]) == pytest.approx(10.0)
    assert float(throughput["tokens/s over the span"]) == pytest.approx(200 / 110, rel=1e-3)  # 4 digits shown
    assert "from each row's started_at and finished_at" in html.unescape(text)  # what the figures mean


def test_throughput_of_rows_too_short_to_time_says_so_instead_of_a_rate(tmp_path: Path) -> None:
    t0 = 1_700_000_000.0
    timed_shard(tmp_path, "j1", 128, t0, t0)  # started and finished within the same millisecond
    text = pipeline.report(str(tmp_path / "timed"))
    (throughput,) = Page(text).table_with("tokens/s while generating")
    assert throughput["tokens/s while generating"] == throughput["tokens/s over the span"] == "—"
    assert throughput["span (s)"] == "0.0" and "too short to measure a rate" in text and "128.0" not in text
    timed_shard(tmp_path, "j2", 72, t0 + 4, t0 + 4)  # another, 4 s later: a span, still no time generating
    (throughput,) = Page(pipeline.report(str(tmp_path / "timed"))).table_with("tokens/s while generating")
    assert (throughput["tokens/s over the span"], throughput["tokens/s while generating"]) == ("50", "—")


def test_report_shows_rows_tokens_per_adapter_version_and_the_base(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    for job_id, adapters in (("base", [None]), ("lora", ["sql@v1", "sql@v2", "math@v1", "sql@v2", "sql@v1"])):
        base = RolloutRequest.model_validate({"id": "r", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}})
        requests = [base.model_copy(update={"id": f"{job_id}-{i}", "adapter": adapter})  # pinned, as a worker runs it
                    for i, adapter in enumerate(adapters)]
        outputs = [[SampleOutput(token_ids=np.arange(1, 2 + i, dtype=np.int32), finish=Finish("length"),
                                 logprobs=np.full(1 + i, -1.0, np.float32))]
                   for i in range(len(adapters))]
        if job_id == "lora":  # the last row was continued on v2 by a partial push after 2 of its 5 tokens
            outputs[-1][0].adapter_version_segments = [(0, 1), (2, 2)]
        ctx = RowContext(run="lora", job_id=job_id, engine="sim", model="m", worker_id="w", weight_version=0,
                         submitted_at=now, started_at=now, finished_at=now)
        write_shard(build_table(requests, outputs, ctx), f"file://{tmp_path}", "lora", job_id)
    (table,) = [t for t in Page(pipeline.report(str(tmp_path / "lora"))).tables if t[0][0] == "adapter"]
    # Tokens: 1, then 1, 2, 3, 4, 5 a row; the last row counts under v1 (its oldest), its tokens under each.
    assert table[0] == ["adapter", "version", "rows", "continued", "tokens", "mean reward"]
    assert table[1:] == [["base", "—", "1", "0", "1", "—"], ["math", "v1", "1", "0", "3", "—"],
                         ["sql", "v1", "2", "1", "3", "—"],
                         ["sql", "v2", "2", "0", "9", "—"]]
    timed_shard(tmp_path, "j1", 4, 0.0, 1.0)  # a run on the base alone has no such section
    assert "LoRA adapters" not in pipeline.report(str(tmp_path / "timed"))


def turn_shard(out: Path, run: str, job_id: str, turns: list[tuple[TurnTag | None, int]]) -> tuple[str, pa.Table]:
    """A shard of agent turns (`pipeline serve`) through the workers' own row builder: each turn
    one request with `n` samples; without tags, a batch job's rows."""
    now = datetime.now(UTC)
    requests = [RolloutRequest.model_validate({"id": f"{job_id}-{i}", "input_ids": [1, 2, 3],
                                               "sampling_params": {"max_new_tokens": 4, "n": n}, "logprobs": 0})
                for i, (_, n) in enumerate(turns)]
    outputs = [[SampleOutput(token_ids=np.array([5, 6, 7], np.int32), finish=Finish("length"),
                             logprobs=np.array([-0.5, -1.0, -2.0], np.float32)) for _ in range(n)] for _, n in turns]
    tags = [tag for tag, _ in turns]
    ctx = RowContext(run=run, job_id=job_id, engine="sim", model="m", worker_id="w", weight_version=2,
                     submitted_at=now, started_at=now, finished_at=now, turns=None if None in tags else tags)
    table = build_table(requests, outputs, ctx)
    return write_shard(table, f"file://{out}", run, job_id), table


def test_report_counts_agent_turns_sessions_and_prefix_breaks(redis_client: redis.Redis, tmp_path: Path) -> None:
    run = "agents"
    url, table = turn_shard(tmp_path, run, "turns-1", [
        (TurnTag(turn_id="a0", session_id="sa", turn=0, reply_to="srv"), 2),
        # n=2: two rows, one turn
        (TurnTag(turn_id="a1", session_id="sa", turn=1, reply_to="srv", prefix_break=True), 2),
        (TurnTag(turn_id="b0", session_id="sb", turn=0, reply_to="srv"), 1),
    ])
    commit_log.append(redis_client, run, commit_log.Commit(job_id="turns-1", batch_id="turns", url=url, rows=5,
                                                           tokens=15, weight_version=2))
    store = SessionStore(redis_client)
    for session_id, turns in (("sa", [False, True, False]), ("sb", [False])):
        session = store.create(run=run, pool="default", output=f"file://{tmp_path}", session_id=session_id)
        for index, prefix_break in enumerate(turns):
            pending = Pending(f"{index:06x}", f"req{index}", "", 1)
            turn = store.open(session_id, same=None, claim=pending, pool="default").turn
            assert turn is not None
            store.record(session,
                         TurnRecord(turn, pending.turn_id(session_id, turn), f"req{index}", "", 1, [1], None, [], {}),
                         (2, 2), Placed("w", "w", None, prompt_tokens=3, cached_tokens=0), None, None,
                         prefix_break=prefix_break)
    # sa's third turn is logged but not flushed to a shard yet
    redis_client.xadd(keys.turn_log(run), {"turn": "sa2", "rows": rows_to_ipc(table.slice(0, 1))})

    page = Page(pipeline.report(run, conn=redis_client))
    assert page.titles[0] == "Agent sessions"
    shown = {line["from"]: line for line in page.table_with("prefix breaks")}
    assert shown["shards"] == {"from": "shards", "agent turns": "3", "prefix breaks": "1", "sessions": "2",
                               "rows": "5"}
    redis_counts = shown["Redis (the run's turn counts)"]
    assert (redis_counts["agent turns"], redis_counts["prefix breaks"]) == ("4", "1")
    text = pipeline.report(run, conn=redis_client)
    assert "1 turn(s) are in the run&#x27;s turn log, not yet in a shard" in text and "Redis counts" not in text

    by_url = Page(pipeline.report(url))  # a URL: the shards' counts only
    assert [line["from"] for line in by_url.table_with("prefix breaks")] == ["shards"]

    batch_url, _ = turn_shard(tmp_path, "batch", "job-1", [(None, 2)])
    assert "Agent sessions" not in Page(pipeline.report(batch_url)).titles


def test_report_without_out_writes_into_the_state_directory(dense_run: str, tmp_path: Path,
                                                            pipeline_env: dict[str, str]) -> None:
    """Not into whatever directory the user stands in (issue 45): `reports/<run>.html` under
    PIPELINE_HOME, its path printed."""
    done = subprocess.run([*PIPELINE, "report", "dense"], env=pipeline_env, capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = Path(pipeline_env["PIPELINE_HOME"]) / "reports" / "dense.html"
    assert written.is_file() and str(written) in done.stdout and written.as_uri() in done.stdout
    assert not (tmp_path / "report.html").exists()
