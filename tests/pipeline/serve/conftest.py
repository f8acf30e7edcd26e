"""Fixtures for `pipeline serve`: a real Redis, a real uvicorn server on a free port, a worker.

The worker runs in the test's main thread (`tests.helpers.processes.drive_worker`: RQ installs signal
handlers) until idle; the agent under test runs in another thread against the server's URL.
A scripted model (`FakeEngine(replies=...)`) answers fixed token ids per turn, so tool-calling
episodes are exact; the tiny-tools fixture tokenizer renders and parses them.
"""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from transformers import AutoTokenizer

from pipeline.serve.server import ServeConfig, Server
from schemas.request import RolloutRequest
from tests.conftest import PIPELINE
from tests.helpers.processes import drive_worker, stop_all
from workers.engines.fake import FakeEngine

TOKENIZER = Path(__file__).resolve().parents[2] / "fixtures" / "tokenizers" / "tiny-tools"
SIM = ("--sim-step-ms", "1", "--sim-median-tokens", "8", "--sim-p99-tokens", "9")


@pytest.fixture(scope="session")
def tools_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@dataclass
class Script:
    """A scripted model: the text each turn of a session answers (by turn index), tokenized; or, with
    `by_prompt` (or `by_request`), the text it answers a prompt (or a request) with (for calls made in
    parallel, whose turn numbers are in the order they reach the server). `seen` holds each request,
    `sampled` the ids answered."""

    tokenizer: Any
    turns: dict[int, str] = field(default_factory=dict)
    default: str = "ok"
    by_prompt: Callable[[str], str] | None = None
    by_request: Callable[[RolloutRequest, str], str] | None = None  # (request, its prompt's text) -> reply
    seen: list[RolloutRequest] = field(default_factory=list)
    sampled: dict[str, list[int]] = field(default_factory=dict)

    def reply(self, request: RolloutRequest, index: int) -> Sequence[int]:
        self.seen.append(request)
        if self.by_request is not None:
            text = self.by_request(request, self.tokenizer.decode(request.input_ids, skip_special_tokens=False))
        elif self.by_prompt is not None:
            text = self.by_prompt(self.tokenizer.decode(request.input_ids, skip_special_tokens=False))
        else:
            text = self.turns.get(int(request.id.rsplit(":", 1)[1]), self.default)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        self.sampled[request.id] = ids
        return ids

    def engine(self, **kwargs: Any) -> FakeEngine:
        return FakeEngine(replies=self.reply, end_ids=[self.tokenizer.eos_token_id], **kwargs)


@dataclass
class Stack:
    conn: redis.Redis
    server: Server
    output: str
    run: str

    @property
    def url(self) -> str:
        return self.server.url

    def session(self, **body: Any) -> str:
        import httpx

        answer = httpx.post(f"{self.url}/sessions", json=body, timeout=30)
        answer.raise_for_status()
        return answer.json()["session_id"]


@pytest.fixture
def serve(redis_client: redis.Redis, tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """`serve(**config)`: a server on a free port over `redis_client` (stopped after the test)."""
    servers: list[Server] = []

    def start(**overrides: Any) -> Stack:
        options: dict[str, Any] = {"port": 0, "tokenizer": str(TOKENIZER), "tool_call_parser": "hermes",
                                   "run": "agents", "output": f"file://{tmp_path}/shards", "turn_timeout_s": 30.0}
        options.update(overrides)
        server = Server(ServeConfig(**options), _turns(ServeConfig(**options), redis_client)).start()
        servers.append(server)
        return Stack(redis_client, server, options["output"], options["run"])

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def sim_workers(pipeline_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen]]:
    """`sim_workers()`: one more real `pipeline worker --engine sim` process (it serves LoRA adapters)."""
    processes: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        log = (tmp_path / f"worker{len(processes)}.log").open("w")
        processes.append(subprocess.Popen([*PIPELINE, "worker", "--engine", "sim", "--heartbeat-interval", "0.5",
                                           "--log-level", "WARNING", *SIM],
                                          env=pipeline_env, stdout=log, stderr=subprocess.STDOUT))
        return processes[-1]

    yield start
    stop_all(processes)


def _turns(config: ServeConfig, conn: redis.Redis) -> Any:
    from pipeline.serve.server import build_turns

    return build_turns(config, conn)


def run_agent(conn: redis.Redis, engine: FakeEngine | Any, agent: Callable[[], None], **worker: Any) -> Any:
    """Serve `agent` (a callable making calls) with a worker around `engine` until both are done (then
    a warm-shutdown SIGTERM: the jobs in flight finish, the worker exits)."""
    return drive_worker(conn, engine, agent, stop_when_done=True, **worker)


def exact_trajectory(conn: redis.Redis, run: str, session_id: str, turns: int) -> dict[str, Any]:
    """Assert that `session_id`'s `turns` turns are one trajectory (the client replayed its history as
    served: no prefix break), each turn's prompt extending the last turn's prompt + completion token
    by token, with the loss mask 1 exactly on sampled tokens; return the trajectory item."""
    import pipeline
    from pipeline.read.lineage_rows import turn_rows

    rows = sorted((r for r in turn_rows(run, conn).to_pylist() if r["session_id"] == session_id),
                  key=lambda r: (r["turn"], r["sample_index"]))
    assert [(r["turn"], r["prefix_break"]) for r in rows] == [(t, False) for t in range(turns)]
    for earlier, later in itertools.pairwise(rows):
        head = earlier["prompt_token_ids"] + earlier["completion_token_ids"]
        assert later["prompt_token_ids"][: len(head)] == head, f"turn {later['turn']} does not extend the last"
    items = [i for i in pipeline.read_trajectories(run, conn=conn).to_pylist() if i["session_id"] == session_id]
    assert len(items) == 1, [(i["lineage"], i["turns"]) for i in items]
    (item,) = items
    assert item["lineages"] == 1 and item["turns"] == list(range(turns))
    assert item["input_ids"] == rows[-1]["prompt_token_ids"] + rows[-1]["completion_token_ids"]
    sampled = [p for r in rows for p in range(len(r["prompt_token_ids"]),
                                              len(r["prompt_token_ids"]) + len(r["completion_token_ids"]))]
    assert len(item["loss_mask"]) == len(item["input_ids"]) and set(item["loss_mask"]) <= {0, 1}
    assert [p for p, m in enumerate(item["loss_mask"]) if m == 1] == sampled
    assert item["turn_starts"] == [len(r["prompt_token_ids"]) for r in rows]
    return item


def exact_lineages(conn: redis.Redis, run: str, session_id: str, script: Script) -> list[dict[str, Any]]:
    """Assert that `session_id`'s calls form a tree whose lineages are exact against the engine: each
    call's row holds the prompt ids the engine was given and the ids it sampled; a call with a parent
    starts with its parent's prompt + completion; each lineage (one per leaf) is its leaf's prompt +
    completion, its path the parent pointers from the leaf, and its loss mask 1 exactly on the ids
    the engine sampled for the calls on the path. Return the lineages, in `read_trajectories` order."""
    import pipeline
    from pipeline.read.lineage_rows import turn_rows

    rows = {r["turn"]: r for r in turn_rows(run, conn).to_pylist() if r["session_id"] == session_id}
    given = {request.id: list(request.input_ids) for request in script.seen}
    assert sorted(rows) == list(range(len(rows))) and len(rows) == len(given)
    for turn, row in rows.items():
        assert row["prompt_token_ids"] == given[f"{session_id}:{turn}"], f"call {turn}: not the engine's prompt"
        assert row["completion_token_ids"] == script.sampled[f"{session_id}:{turn}"], f"call {turn}: not sampled"
        if row["parent_turn"] is not None:
            parent = rows[row["parent_turn"]]
            head = parent["prompt_token_ids"] + parent["completion_token_ids"]
            assert row["prompt_token_ids"][: len(head)] == head, f"call {turn} does not extend {parent['turn']}"
    parents = {row["parent_turn"] for row in rows.values()}
    leaves = sorted(turn for turn in rows if turn not in parents)
    items = [i for i in pipeline.read_trajectories(run, conn=conn).to_pylist() if i["session_id"] == session_id]
    assert sorted(item["turns"][-1] for item in items) == leaves
    for item in items:
        path = [item["turns"][-1]]
        while rows[path[0]]["parent_turn"] is not None:
            path.insert(0, rows[path[0]]["parent_turn"])
        assert item["turns"] == path and item["lineages"] == len(leaves)
        leaf = rows[path[-1]]
        assert item["input_ids"] == leaf["prompt_token_ids"] + leaf["completion_token_ids"]
        spans = [(len(rows[t]["prompt_token_ids"]), len(rows[t]["completion_token_ids"])) for t in path]
        sampled = [p for start, length in spans for p in range(start, start + length)]
        assert [p for p, m in enumerate(item["loss_mask"]) if m == 1] == sampled
        assert [item["input_ids"][p] for p in sampled] == [i for t in path for i in rows[t]["completion_token_ids"]]
    return items
