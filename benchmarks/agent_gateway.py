"""Agent gateways side by side on one zero-time backend: rllm-model-gateway vs `pipeline serve`.

Same load for every system, in one run, order rotated each repeat: S concurrent agent sessions x
T turns (AsyncOpenAI, one shared httpx pool); each turn sends the whole conversation, which grows
by the previous answer and a ~200-token tool result (a user message; the stand-in answers plain
text, so there are no tool calls to answer). Systems (--systems, comma-separated):

  direct        the stand-in's /v1/chat/completions itself (the floor)
  rllm          rllm-model-gateway (its own venv) in front of the stand-in's /v1
  pipeline1     `pipeline serve` + 1 `pipeline worker --engine sglang-http --url <stand-in>`
  pipeline2     the same with 2 workers
  pipelinesim   `pipeline serve` + 1 sim worker at infinite speed (16-token replies), as in
                benchmarks/serve.py (optional)
  pipeline1tcp  pipeline1 on a redis-server on a loopback port with appendfsync everysec (what
                benchmarks/serve.py runs on) instead of the embedded one (unix socket, appendfsync
                always) (optional)

The backend is gw_standin.py (next to this file): vLLM-shaped /v1/chat/completions (renders the chat
template, returns token_ids/prompt_token_ids/logprobs on request) and SGLang's native /generate,
both answering a fixed 16-token completion at once. Each (system, repeat) starts its own gateway
processes and stops them after (by PID); the stand-in and the pipeline's embedded Redis
(`pipeline redis start`) live for the whole run. Per measurement: load average at start and end,
turns/s, p50/p99 turn latency, CPU ms per turn of each process, and an unloaded floor (one
session alone). After each loaded run the captured traces are checked: per turn, token ids and
logprobs present, and turn k+1's prompt ids starting with turn k's prompt + completion ids.
A last phase repeats that check against a stand-in whose sampled ids are non-canonical (--split),
where a gateway that re-tokenizes the text breaks the prefix.

The peer harness of issue 43 (`../shared/bench/agent_gateway_bench.py`), carried in the project
with its imports following the package layout. Run (the project's venv has openai, httpx,
transformers and `pipeline`):

    .venv/bin/python benchmarks/agent_gateway.py \\
        [--sessions 64 --turns 8 --repeats 3 --systems direct,rllm,pipeline1,pipeline2,pipelinesim] \\
        [--out results.json] [--profile] [--project PROJECT --rllm-venv RLLM_VENV --tokenizer MODEL_DIR]

Every process runs with a fresh HOME (`--home` to choose one). The rllm venv is built on first use
(`rllm-model-gateway==0.1.0`, pinned, under ~/.cache/rollout-pipeline/bench; PyPI reachable once);
the tokenizer is the demo model's (`pipeline demo` converts it once). --profile adds a
pass (not timed) that runs `pipeline serve`, one worker and the rllm gateway under cProfile and
prints each one's top functions (main thread only; the .prof files are kept beside --out).
--fsync-ab R adds R alternating rounds of pipeline1 with the embedded Redis's appendfsync `always`
vs `everysec` on the same server, and Redis commands per turn. Ports are random in 19000-19999.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

HERE = Path(__file__).resolve().parent
RLLM_GATEWAY = "rllm-model-gateway==0.1.0"  # the peer, pinned
USED_PORTS: set[int] = set()


# -- processes -----------------------------------------------------------------------------------

def free_port() -> int:
    for _ in range(1000):
        port = random.randint(19000, 19999)
        if port in USED_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        USED_PORTS.add(port)
        return port
    raise SystemExit("no free port in 19000-19999")


class Proc:
    """A process this script started; stopped by its PID (then its own process group)."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str]):
        self.name = name
        self.log = open(logdir / f"{name}.log", "ab")  # noqa: SIM115 (open while the process lives; closed in stop)
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        self.profiled = "cProfile" in argv
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            # SIGINT under cProfile: uvicorn re-raises the signal it caught once it has shut down, and
            # SIGTERM's default action would end the process before cProfile writes its file
            os.kill(self.pid, signal.SIGINT if self.profiled else signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)  # the group this script created for it
                self.popen.wait(5)
        self.log.close()


def descendants(pid: int) -> list[int]:
    """pid and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_s(pid: int, tree: bool = True) -> float:
    """CPU seconds (user + system, itself and its reaped children) of a process and (tree) its live descendants."""
    total = 0.0
    for p in descendants(pid) if tree else [pid]:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")
    return total


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def wait_http(url: str, ok, what: str, timeout: float = 180.0, procs: list[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise SystemExit(f"{p.name} exited (rc {p.popen.returncode}); see its log")
        try:
            r = httpx.get(url, timeout=3)
            if ok(r):
                return
            last = f"HTTP {r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise SystemExit(f"{what} did not come up: {last}")


# -- the agents ----------------------------------------------------------------------------------

class Conversation:
    """The texts of a session's turns: a task, then per turn a ~N-token tool result."""

    def __init__(self, tokenizer_dir: str, tool_tokens: int):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        probe = self._tool(0, 0, 40)
        per_item = len(tok.encode(probe, add_special_tokens=False)) / 40
        self.items = max(1, round(tool_tokens / per_item))
        self.tool_tokens = len(tok.encode(self._tool(1, 1, self.items), add_special_tokens=False))

    @staticmethod
    def _tool(session: int, turn: int, items: int) -> str:
        return "Tool result:\n" + "\n".join(f"row {j}: id={(session * 7919 + turn * 104729 + j * 31) % 100000} ok"
                                            for j in range(items))

    def task(self, session: int) -> str:
        return (f"Task {session}: inspect the files of project {session % 97} one at a time and report the "
                "value of the setting named max_depth; call a tool for each step and explain briefly.")

    def tool(self, session: int, turn: int) -> str:
        return self._tool(session, turn, self.items)


class Target:
    """Where an agent session's calls go, and how a session is opened there."""

    def __init__(self, kind: str, base: str):
        self.kind, self.base = kind, base  # kind: direct | rllm | pipeline

    async def open(self, http: httpx.AsyncClient) -> tuple[str | None, str]:
        if self.kind == "direct":
            return None, f"{self.base}/v1"
        if self.kind == "rllm":
            sid = f"s-{uuid.uuid4().hex}"
            r = await http.post(f"{self.base}/sessions", json={"session_id": sid})
            r.raise_for_status()
            return sid, f"{self.base}/sessions/{sid}/v1"
        r = await http.post(f"{self.base}/sessions", json={})
        r.raise_for_status()
        sid = r.json()["session_id"]
        return sid, f"{self.base}/sessions/{sid}/v1"


async def agent(target: Target, http: httpx.AsyncClient, conv: Conversation, index: int, turns: int,
                reply_tokens: int, latencies: list[float], errors: list[str], sids: list[str]) -> None:
    try:
        sid, base = await target.open(http)
    except Exception as exc:
        errors.append(f"open: {exc!r}")
        return
    if sid:
        sids.append(sid)
    client = AsyncOpenAI(base_url=base, api_key="unused", http_client=http, max_retries=0, timeout=180)
    messages: list[dict[str, str]] = [{"role": "user", "content": conv.task(index)}]
    for turn in range(turns):
        started = time.perf_counter()
        try:
            answer = await client.chat.completions.create(model="standin", messages=messages,
                                                          max_tokens=reply_tokens)
        except Exception as exc:
            cause = exc.__cause__ or exc.__context__
            errors.append(f"session {index} turn {turn}: {exc!r}" + (f" <- {cause!r}" if cause else "")[:400])
            return
        latencies.append(time.perf_counter() - started)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        messages.append({"role": "user", "content": conv.tool(index, turn)})


async def load(target: Target, conv: Conversation, sessions: int, turns: int, concurrency: int,
               reply_tokens: int, first_index: int = 0) -> dict[str, Any]:
    latencies: list[float] = []
    errors: list[str] = []
    sids: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=180) as http:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await agent(target, http, conv, first_index + i, turns, reply_tokens, latencies, errors, sids)

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(sessions)))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "latencies": latencies, "errors": errors, "sids": sids}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- trace checks --------------------------------------------------------------------------------

def check_turns(per_session: dict[str, list[dict[str, Any]]], turns: int) -> dict[str, Any]:
    """Each value: a session's turns in order, dicts with prompt, completion, logprobs."""
    sessions = len(per_session)
    complete = sum(1 for ts in per_session.values() if len(ts) == turns)
    with_ids = with_lp = total = 0
    pairs = extends = 0
    first_break = None
    for sid, ts in per_session.items():
        for t in ts:
            total += 1
            with_ids += bool(t["prompt"]) and bool(t["completion"])
            with_lp += bool(t["logprobs"]) and len(t["logprobs"]) == len(t["completion"])
        for k in range(len(ts) - 1):
            head = ts[k]["prompt"] + ts[k]["completion"]
            pairs += 1
            if ts[k + 1]["prompt"][: len(head)] == head:
                extends += 1
            elif first_break is None:
                nxt = ts[k + 1]["prompt"]
                at = next((i for i, (a, b) in enumerate(zip(head, nxt, strict=False)) if a != b),
                          min(len(head), len(nxt)))
                first_break = {"session": sid, "turn": k + 1, "position": at, "prompt_len": len(ts[k]["prompt"]),
                               "expected": head[at:at + 6], "got": nxt[at:at + 6]}
    return {"sessions": sessions, "complete_sessions": complete, "turns": total, "with_token_ids": with_ids,
            "with_logprobs": with_lp, "prefix_pairs": pairs, "prefix_extends": extends, "first_break": first_break}


def rllm_traces(base: str, sids: list[str], turns: int) -> dict[str, Any]:
    per: dict[str, list[dict[str, Any]]] = {}
    deadline = time.monotonic() + 30
    with httpx.Client(timeout=60) as http:
        for sid in sids:
            while True:
                traces = http.get(f"{base}/sessions/{sid}/traces").json()
                if len(traces) >= turns or time.monotonic() > deadline:
                    break
                time.sleep(0.2)  # trace writes are asynchronous
            traces.sort(key=lambda t: t.get("timestamp", 0))
            per[sid] = [{"prompt": t.get("prompt_token_ids") or [], "completion": t.get("completion_token_ids") or [],
                         "logprobs": t.get("logprobs") or []} for t in traces]
    return check_turns(per, turns)


def pipeline_traces(run: str, turns: int, sids: list[str], redis_url: str | None = None) -> dict[str, Any]:
    """The run's turn rows (turn log or shards) of the sessions in `sids`, and its trajectories."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipeline.core.broker.connection import connect_redis
    from pipeline.read.lineage_rows import turn_rows
    from pipeline.read.trajectories import read_trajectories

    conn = connect_redis(redis_url) if redis_url else connect_redis()
    table = turn_rows(run, conn)
    table = table.filter(pc.is_in(table.column("session_id"), value_set=pa.array(sids)))
    rows = table.to_pylist()
    per: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: (r["session_id"], r["turn"])):
        per.setdefault(r["session_id"], []).append(
            {"prompt": r["prompt_token_ids"] or [], "completion": r["completion_token_ids"] or [],
             "logprobs": r["completion_logprobs"] or []})
    out = check_turns(per, turns)
    traj = read_trajectories(table, rewards={})
    out["trajectory_items"] = traj.num_rows
    # Sessions read as more than one lineage (a call that extended no earlier one: a broken prefix).
    firsts = [n for n, lineage in zip(traj.column("lineages").to_pylist(), traj.column("lineage").to_pylist(),
                                      strict=True) if lineage == 0]
    out["trajectory_lineages_gt1"] = sum(1 for n in firsts if n > 1)
    return out


# -- systems -------------------------------------------------------------------------------------

class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args = args
        self.tmp = tmp
        self.logdir = tmp / "logs"
        self.logdir.mkdir()
        self.env = dict(os.environ, HOME=args.home, PYTHONUNBUFFERED="1")
        self.env.pop("PIPELINE_REDIS_URL", None)
        self.pipeline = str(Path(args.project) / ".venv" / "bin" / "pipeline")
        self.procs: list[Proc] = []
        self.conv = Conversation(args.tokenizer, args.tool_tokens)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, argv, self.logdir, env or self.env)
        self.procs.append(p)
        return p

    def stop(self, procs: list[Proc]) -> None:
        for p in reversed(procs):
            p.stop()
            if p in self.procs:
                self.procs.remove(p)

    def start_standin(self, split: bool = False) -> tuple[Proc, str]:
        port = free_port()
        argv = [sys.executable, str(HERE / "gw_standin.py"), "--port", str(port), "--tokenizer", self.args.tokenizer,
                "--reply-tokens", str(self.args.reply_tokens)] + (["--split"] if split else [])
        p = self.start("standin-split" if split else "standin", argv)
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/health", lambda r: r.status_code == 200, "the stand-in", procs=[p])
        return p, url

    def start_rllm(self, upstream: str, tag: str, profile: Path | None = None) -> tuple[list[Proc], Target]:
        port = free_port()
        exe = str(Path(self.args.rllm_venv) / "bin" / "rllm-model-gateway")
        argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker", f"{upstream}/v1",
                "--db-path", str(self.tmp / f"rllm-{tag}.db"), "--log-level", "warning"]
        if profile:
            argv = [str(Path(self.args.rllm_venv) / "bin" / "python"), "-m", "cProfile", "-o", str(profile), *argv]
        p = self.start(f"rllm-{tag}", argv)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", lambda r: r.status_code == 200, "rllm-model-gateway", procs=[p])
        return [p], Target("rllm", base)

    def start_pipeline(self, upstream: str | None, workers: int, tag: str,
                       profile: tuple[Path, Path] | None = None,
                       redis_url: str | None = None) -> tuple[list[Proc], Target, str]:
        port = free_port()
        pool, run = f"gwb-{tag}", f"gwb-{tag}"
        prof = (lambda path: [str(Path(self.args.project) / ".venv" / "bin" / "python"), "-m", "cProfile", "-o",
                              str(path), self.pipeline]) if profile else (lambda path: [self.pipeline])
        procs = []
        env = dict(self.env, PIPELINE_REDIS_URL=redis_url) if redis_url else self.env
        for w in range(workers):
            if upstream:
                argv = ["worker", "--engine", "sglang-http", "--url", upstream, "--model", self.args.tokenizer,
                        "--pool", pool, "--new-pool"]
            else:
                argv = ["worker", "--engine", "sim", "--pool", pool, "--new-pool", "--sim-step-ms", "0",
                        "--sim-median-tokens", str(self.args.reply_tokens), "--sim-p99-tokens",
                        str(self.args.reply_tokens), "--sim-prefill-tokens-per-s", "0", "--model", self.args.tokenizer]
            procs.append(self.start(f"worker{w}-{tag}", prof(profile[1] if profile else None) + argv, env))
        serve = ["serve", "--host", "127.0.0.1", "--port", str(port), "--tokenizer", self.args.tokenizer, "--run", run,
                 "--pool", pool, "--new-pool", "--output", f"file://{self.tmp}/shards", "--turn-timeout", "120"]
        procs.append(self.start(f"serve-{tag}", prof(profile[0] if profile else None) + serve, env))
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", lambda r: r.status_code == 200 and r.json().get("live_workers", 0) >= workers,
                  "pipeline serve and its workers", procs=procs)
        return procs, Target("pipeline", base), run

    def bring_up(self, system: str, tag: str) -> tuple[list[Proc], Target, str | None]:
        if system == "direct":
            return [], Target("direct", self.standin_url), None
        if system == "rllm":
            procs, target = self.start_rllm(self.standin_url, tag)
            return procs, target, None
        if system in ("pipeline1", "pipeline2"):
            return self.start_pipeline(self.standin_url, int(system[-1]), tag)
        if system == "pipelinesim":
            return self.start_pipeline(None, 1, tag)
        if system == "pipeline1tcp":
            return self.start_pipeline(self.standin_url, 1, tag, redis_url=self.tcp_redis().url)
        raise SystemExit(f"unknown system {system}")

    def measure(self, system: str, rep: int) -> dict[str, Any]:
        a = self.args
        tag = f"{system}-{rep}-{uuid.uuid4().hex[:6]}"
        procs, target, run = self.bring_up(system, tag)
        try:
            asyncio.run(load(target, self.conv, 4, 2, 4, a.reply_tokens, first_index=10_000))  # warm-up
            alone = asyncio.run(load(target, self.conv, a.alone_sessions, a.turns, 1, a.reply_tokens,
                                     first_index=20_000))
            pids = {p.name.split("-")[0]: p.pid for p in procs}
            pids["standin"] = self.standin.pid
            pids["agents"] = os.getpid()
            if system == "pipeline1tcp":
                pids["redis"] = int((self._tcp_redis.directory / "redis.pid").read_text())
            elif system.startswith("pipeline"):
                pids["redis"] = self.redis_pid
            before = {n: cpu_s(p, n != "agents") for n, p in pids.items()}
            la0 = loadavg()
            res = asyncio.run(load(target, self.conv, a.sessions, a.turns, a.sessions, a.reply_tokens))
            la1 = loadavg()
            turns = len(res["latencies"])
            cpu = {n: (cpu_s(p, n != "agents") - before[n]) * 1000 / max(1, turns) for n, p in pids.items()}
            out = {"system": system, "repeat": rep, "load_start": la0, "load_end": la1, "turns": turns,
                   "seconds": res["seconds"], "turns_per_s": turns / res["seconds"],
                   "p50_ms": pct(res["latencies"], 0.5) * 1000, "p99_ms": pct(res["latencies"], 0.99) * 1000,
                   "alone_p50_ms": pct(alone["latencies"], 0.5) * 1000,
                   "alone_p99_ms": pct(alone["latencies"], 0.99) * 1000,
                   "errors": len(res["errors"]) + len(alone["errors"]),
                   "error_samples": (res["errors"] + alone["errors"])[:3], "cpu_ms_per_turn": cpu}
            if system == "rllm" and a.check:
                out["trace"] = rllm_traces(target.base, res["sids"], a.turns)
                db = self.tmp / f"rllm-{tag}.db"  # every turn of the run: warm-up, alone and loaded
                total = turns + len(alone["latencies"]) + 8
                out["trace"]["sqlite_bytes_per_turn"] = round(db.stat().st_size / total) if db.exists() else None
            elif run and a.check:
                out["trace"] = pipeline_traces(run, a.turns, res["sids"],
                                               self._tcp_redis.url if system == "pipeline1tcp" else None)
            return out
        finally:
            self.stop(procs)

    def split_check(self) -> dict[str, Any]:
        """The trace check against a stand-in whose sampled ids are not the text's canonical ids."""
        a = self.args
        sp, url = self.start_standin(split=True)
        out = {}
        try:
            for system in ("rllm", "pipeline1"):
                tag = f"split-{system}-{uuid.uuid4().hex[:6]}"
                if system == "rllm":
                    procs, target = self.start_rllm(url, tag)
                    run = None
                else:
                    procs, target, run = self.start_pipeline(url, 1, tag)
                try:
                    res = asyncio.run(load(target, self.conv, 4, a.turns, 4, a.reply_tokens, first_index=30_000))
                    out[system] = (rllm_traces(target.base, res["sids"], a.turns) if run is None
                                   else pipeline_traces(run, a.turns, res["sids"]))
                    out[system]["errors"] = res["errors"][:3]
                finally:
                    self.stop(procs)
        finally:
            self.stop([sp])
        return out

    def fsync_ab(self, rounds: int) -> dict[str, Any]:
        """pipeline1 on the embedded Redis, its appendfsync switched between `always` (the embedded
        server's setting) and `everysec` with CONFIG SET on the same server, alternating; and the Redis
        commands a turn costs (INFO commandstats), alone and under the load."""
        from pipeline.core.broker.connection import connect_redis

        a = self.args
        conn = connect_redis()
        setting = conn.config_get("appendfsync")["appendfsync"]
        procs, target, _ = self.start_pipeline(self.standin_url, 1, f"fsync-{uuid.uuid4().hex[:6]}")
        out: dict[str, Any] = {"server_setting": setting, "rounds": []}
        try:
            asyncio.run(load(target, self.conv, 4, 2, 4, a.reply_tokens, first_index=40_000))
            for label, sessions, conc in (("commands_per_turn_alone", a.alone_sessions, 1),
                                          ("commands_per_turn_loaded", a.sessions, a.sessions)):
                conn.config_resetstat()
                res = asyncio.run(load(target, self.conv, sessions, a.turns, conc, a.reply_tokens, first_index=41_000))
                calls = sum(v["calls"] for v in conn.info("commandstats").values())
                out[label] = round(calls / max(1, len(res["latencies"])), 1)
            for rnd in range(rounds):
                for mode in ("always", "everysec"):
                    conn.config_set("appendfsync", mode)
                    la0 = loadavg()
                    alone = asyncio.run(load(target, self.conv, a.alone_sessions, a.turns, 1, a.reply_tokens,
                                             first_index=42_000 + rnd))
                    res = asyncio.run(load(target, self.conv, a.sessions, a.turns, a.sessions, a.reply_tokens,
                                           first_index=43_000 + 100 * rnd))
                    out["rounds"].append({"round": rnd, "appendfsync": mode, "load_start": la0, "load_end": loadavg(),
                                          "alone_p50_ms": pct(alone["latencies"], 0.5) * 1000,
                                          "turns_per_s": len(res["latencies"]) / res["seconds"],
                                          "p50_ms": pct(res["latencies"], 0.5) * 1000,
                                          "errors": len(alone["errors"]) + len(res["errors"])})
        finally:
            conn.config_set("appendfsync", setting)
            self.stop(procs)
        return out

    def profile(self) -> dict[str, Any]:
        """serve + 1 worker, and the rllm gateway, under cProfile through one loaded run each (not timed)."""
        import pstats

        a = self.args
        out = {}
        files = {"serve": self.tmp / "serve.prof", "worker": self.tmp / "worker.prof", "rllm": self.tmp / "rllm.prof"}
        procs, target, _ = self.start_pipeline(self.standin_url, 1, f"prof-{uuid.uuid4().hex[:6]}",
                                               profile=(files["serve"], files["worker"]))
        try:
            asyncio.run(load(target, self.conv, a.sessions, a.turns, a.sessions, a.reply_tokens))
        finally:
            self.stop(procs)
        procs, target = self.start_rllm(self.standin_url, f"prof-{uuid.uuid4().hex[:6]}", profile=files["rllm"])
        try:
            asyncio.run(load(target, self.conv, a.sessions, a.turns, a.sessions, a.reply_tokens))
        finally:
            self.stop(procs)
        for name, path in files.items():
            if not path.exists():
                out[name] = "no profile written"
                continue
            import io

            buf = io.StringIO()
            stats = pstats.Stats(str(path), stream=buf)
            stats.sort_stats("tottime").print_stats(25)
            # the project's / the gateway's own functions by cumulative time (the main thread only)
            stats.sort_stats("cumulative").print_stats(r"/(pipeline|workers|schemas|rllm_model_gateway)/", 30)
            out[name] = buf.getvalue()
            if a.out:
                subprocess.run(["cp", str(path), str(Path(a.out).with_suffix(f".{name}.prof"))])
        return out

    def run(self) -> dict[str, Any]:
        a = self.args
        results: dict[str, Any] = {"config": vars(a), "tool_tokens": self.conv.tool_tokens, "measurements": []}
        self.standin, self.standin_url = self.start_standin()
        systems = a.systems.split(",")
        if any(s.startswith("pipeline") for s in systems) or a.split_check or a.profile or a.fsync_ab:
            started = subprocess.run([self.pipeline, "redis", "start"], env=self.env, capture_output=True, text=True)
            if started.returncode:
                raise SystemExit(f"pipeline redis start: {started.stdout} {started.stderr}")
            from pipeline.core.broker.redis_server import embedded_server

            self.redis_pid = int((embedded_server().directory / "redis.pid").read_text())
        # the floor of the floor: SGLang's /generate with a turn's ids, and the stand-in's chat route, one at a time
        results["standin_generate_p50_ms"] = self.generate_floor()
        print(f"tool result ~{self.conv.tool_tokens} tokens; stand-in /generate alone p50 "
              f"{results['standin_generate_p50_ms']:.2f} ms", flush=True)
        for rep in range(a.repeats):
            order = systems[rep % len(systems):] + systems[: rep % len(systems)]
            if rep % 2:
                order = order[::-1]
            for system in order:
                m = self.measure(system, rep)
                results["measurements"].append(m)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in m.items()
                                  if k not in ("cpu_ms_per_turn", "trace")}), flush=True)
                print("   cpu ms/turn:", {k: round(v, 2) for k, v in m["cpu_ms_per_turn"].items()},
                      "| trace:", json.dumps(m.get("trace")), flush=True)
        if a.split_check:
            results["split_check"] = self.split_check()
            print("split check:", json.dumps(results["split_check"]), flush=True)
        if a.fsync_ab:
            results["fsync_ab"] = self.fsync_ab(a.fsync_ab)
            print("fsync A/B:", json.dumps(results["fsync_ab"]), flush=True)
        if a.profile:
            results["profiles"] = self.profile()
            for name, text in results["profiles"].items():
                print(f"--- cProfile {name} (tottime) ---\n{text}", flush=True)
        return results

    def generate_floor(self) -> float:
        ids = list(range(100, 1100))
        lat = []
        with httpx.Client(timeout=30) as http:
            for _ in range(40):
                t0 = time.perf_counter()
                http.post(f"{self.standin_url}/generate", json={
                    "input_ids": ids, "return_logprob": True, "rid": uuid.uuid4().hex,
                    "sampling_params": {"max_new_tokens": self.args.reply_tokens}}).raise_for_status()
                lat.append(time.perf_counter() - t0)
        return pct(lat[5:], 0.5) * 1000

    _tcp_redis = None

    def tcp_redis(self):
        """A redis-server on a loopback port with appendfsync everysec (benchmarks/serve.py's), for pipeline1tcp."""
        if self._tcp_redis is None:
            from pipeline.core.broker.redis_server import RedisServer

            self._tcp_redis = RedisServer(self.tmp / "tcp-redis", port=free_port())
            self._tcp_redis.__enter__()
        return self._tcp_redis

    def close(self) -> None:
        self.stop(list(self.procs))
        if self._tcp_redis is not None:
            self._tcp_redis.__exit__(None, None, None)
        if getattr(self, "redis_pid", None):
            subprocess.run([self.pipeline, "redis", "stop"], env=self.env, capture_output=True)


def summarize(results: dict[str, Any]) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for m in results["measurements"]:
        by.setdefault(m["system"], []).append(m)
    med = lambda ms, k: statistics.median(m[k] for m in ms)  # noqa: E731
    lines = [f"{'system':12} {'turns/s (min-max)':>22} {'p50 ms':>8} {'p99 ms':>8} {'alone p50':>10} "
             f"{'errors':>6}  load avg start -> end per repeat"]
    for system, ms in by.items():
        rates = [m["turns_per_s"] for m in ms]
        lines.append(f"{system:12} {med(ms, 'turns_per_s'):8.1f} ({min(rates):5.1f}-{max(rates):5.1f})     "
                     f"{med(ms, 'p50_ms'):8.1f} {med(ms, 'p99_ms'):8.1f} {med(ms, 'alone_p50_ms'):10.2f} "
                     f"{sum(m['errors'] for m in ms):6d}  " + "; ".join(f"{m['load_start']} -> {m['load_end']}"
                                                                       for m in ms))
    lines.append("CPU ms per turn under load (median over repeats):")
    for system, ms in by.items():
        names = ms[0]["cpu_ms_per_turn"].keys()
        lines.append(f"  {system:12} " + ", ".join(
            f"{n} {statistics.median(m['cpu_ms_per_turn'][n] for m in ms):.2f}" for n in names))
    # ratios measured within each repeat
    systems = list(by)
    reps = sorted({m["repeat"] for m in results["measurements"]})
    get = {(m["system"], m["repeat"]): m for m in results["measurements"]}
    pairs = [(s, "rllm") for s in systems if s.startswith("pipeline")] + \
            [(s, "direct") for s in systems if s != "direct"]
    lines.append("ratios within each repeat (turns/s ratio; p50 ratio), median over repeats:")
    for x, y in pairs:
        if y not in by:
            continue
        tr = [get[(x, r)]["turns_per_s"] / get[(y, r)]["turns_per_s"] for r in reps if (x, r) in get and (y, r) in get]
        pr = [get[(x, r)]["p50_ms"] / get[(y, r)]["p50_ms"] for r in reps if (x, r) in get and (y, r) in get]
        ar = [get[(x, r)]["alone_p50_ms"] - get[(y, r)]["alone_p50_ms"] for r in reps
              if (x, r) in get and (y, r) in get]
        lines.append(f"  {x} / {y}: turns/s x{statistics.median(tr):.2f} ({', '.join(f'{v:.2f}' for v in tr)}); "
                     f"loaded p50 x{statistics.median(pr):.2f}; alone p50 {statistics.median(ar):+.2f} ms")
    return "\n".join(lines)


def _demo_model() -> str:
    """The demo model's directory (`pipeline demo` converts it once)."""
    sys.path.insert(0, str(HERE.parent))
    from pipeline.core.demo_model import resolve

    return resolve("demo")


def _rllm_venv() -> str:
    """The peer's venv, built once with the pinned `rllm-model-gateway` (it needs the network once)."""
    venv = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollout-pipeline" / "bench" / \
        RLLM_GATEWAY.replace("==", "-")
    if not (venv / "bin" / "rllm-model-gateway").exists():
        print(f"building the peer's venv at {venv} ({RLLM_GATEWAY}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", RLLM_GATEWAY], check=True)
    return str(venv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", default=str(HERE.parent), help="rollout-pipeline checkout with its .venv "
                    "(default: this one)")
    ap.add_argument("--rllm-venv", default=None, help="venv with rllm-model-gateway installed (default: built "
                    f"once, pinned to {RLLM_GATEWAY}, under the benchmark cache)")
    ap.add_argument("--tokenizer", default=None, help="model/tokenizer directory both systems load (default: the "
                    "demo model, converted by `pipeline demo`)")
    ap.add_argument("--home", default=None, help="HOME of every process (the embedded Redis's state; default: a "
                    "fresh one for the run)")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--tool-tokens", type=int, default=200)
    ap.add_argument("--alone-sessions", type=int, default=4, help="sessions run one at a time for the floor")
    ap.add_argument("--systems", default="direct,rllm,pipeline1,pipeline2")
    ap.add_argument("--no-check", dest="check", action="store_false")
    ap.add_argument("--no-split-check", dest="split_check", action="store_false")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--fsync-ab", type=int, default=0, metavar="ROUNDS",
                    help="after the measurements: pipeline1 with the embedded Redis's appendfsync always vs "
                         "everysec (CONFIG SET on the same server), ROUNDS alternating rounds")
    ap.add_argument("--out", default=None, help="write every figure as JSON here")
    args = ap.parse_args()
    args.tokenizer = args.tokenizer or _demo_model()
    args.rllm_venv = args.rllm_venv or (_rllm_venv() if "rllm" in args.systems.split(",") else "")
    os.environ.pop("PIPELINE_REDIS_URL", None)
    with tempfile.TemporaryDirectory(prefix="gwbench-") as tmp:
        if args.home is None:
            args.home = str(Path(tmp) / "home")
            Path(args.home).mkdir()
        os.environ["HOME"] = args.home
        bench = Bench(args, Path(tmp))
        try:
            results = bench.run()
        finally:
            bench.close()
            if args.out:
                logs = Path(args.out).with_suffix(".logs")
                subprocess.run(["cp", "-r", str(Path(tmp) / "logs"), str(logs)])
    print(summarize(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
