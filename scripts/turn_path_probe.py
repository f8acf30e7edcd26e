"""Which of the project's files run, in which threads, for one warm agent turn and one batch job.

The measure behind docs/design.md "Two paths through the code" (issue 55's target: a warm turn in
<= 35 project files and <= 6 threads across serve and worker). Counts, not timings: they do not
depend on the machine's load.

  python scripts/turn_path_probe.py drive            # redis, `pipeline serve`, `pipeline worker --engine sim`,
                                                     # each traced; prints the counts; artefacts in /tmp/paths_probe
  python scripts/turn_path_probe.py trace OUT ARGV.. # internal: `pipeline ARGV` under the recorder

Recorder: sys.setprofile + threading.setprofile; records (thread, file, function) for each call in
pipeline/, workers/, schemas/. A flag file OUT.reset resets it, OUT.dump dumps it to OUT.<n>.json
(signals would wait for the worker's main thread, which RQ's dequeue keeps blocked).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = str(Path(__file__).resolve().parents[1]) + "/"
PKGS = tuple(REPO + p for p in ("pipeline/", "workers/", "schemas/"))


class Recorder:
    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, str], int] = {}
        self.cache: dict[object, str | None] = {}

    def hook(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        rel = self.cache.get(code, 0)
        if rel == 0:
            fn = code.co_filename
            rel = fn[len(REPO):] if fn.startswith(PKGS) else None
            self.cache[code] = rel
        if rel is None:
            return
        key = (threading.current_thread().name, rel, code.co_qualname)
        self.seen[key] = self.seen.get(key, 0) + 1

    def install(self) -> None:
        sys.setprofile(self.hook)
        threading.setprofile(self.hook)
        # threads already running (none at start) are not hooked; all ours start after this

    def dump(self, path: str) -> None:
        rows = [{"thread": t, "file": f, "func": q, "calls": n} for (t, f, q), n in sorted(self.seen.items())]
        Path(path).write_text(json.dumps(rows, indent=0))


def trace(out: str, argv: list[str]) -> int:
    rec = Recorder()
    n = [0]

    def reset(*_):
        rec.seen = {}

    def dump(*_):
        n[0] += 1
        rec.dump(f"{out}.{n[0]}.json")

    def watch():  # signals wait for the main thread, which a worker keeps blocked: poll files instead
        while True:
            time.sleep(0.05)
            for sig, fn in (("reset", reset), ("dump", dump)):
                flag = Path(f"{out}.{sig}")
                if flag.exists():
                    flag.unlink()
                    fn()

    threading.Thread(target=watch, name="probe", daemon=True).start()
    rec.install()
    from pipeline.cli.main import main
    return main(argv)


def summary(path: str) -> dict:
    rows = json.loads(Path(path).read_text())
    files = sorted({r["file"] for r in rows})
    threads = sorted({r["thread"] for r in rows})
    by_thread = {t: sorted({r["file"] for r in rows if r["thread"] == t}) for t in threads}
    return {"files": len(files), "threads": threads, "by_thread": by_thread}


def _flag(p: subprocess.Popen, what: str) -> None:
    Path(f"{p.probe_out}.{what}").touch()  # type: ignore[attr-defined]


def drive() -> None:
    import httpx
    import redis

    sys.path.insert(0, REPO)
    from pipeline.core.broker.redis_server import RedisServer
    from tests.helpers.processes import free_port

    tmp = Path("/tmp/paths_probe")
    subprocess.run(["rm", "-rf", str(tmp)])
    tmp.mkdir()
    server = RedisServer(tmp / "redis", port=free_port())
    server.ensure_started()
    url = server.url
    env = {**os.environ, "PIPELINE_REDIS_URL": url, "PYTHONPATH": REPO, "PIPELINE_STATE_DIR": str(tmp / "state")}
    py = sys.executable
    port = free_port()
    tok = REPO + "tests/fixtures/tokenizers/tiny-tools"
    shards = f"file://{tmp}/shards"
    serve = subprocess.Popen([py, __file__, "trace", str(tmp / "serve"), "serve", "--port", str(port),
                              "--tokenizer", tok, "--run", "agents", "--output", shards],
                             env=env, stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115 (open for the process's life)
    worker = subprocess.Popen([py, __file__, "trace", str(tmp / "worker"), "worker", "--engine", "sim",
                               "--sim-step-ms", "1", "--sim-median-tokens", "8", "--sim-p99-tokens", "16"],
                              env=env, stdout=open(tmp / "worker.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    serve.probe_out, worker.probe_out = str(tmp / "serve"), str(tmp / "worker")
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                break
        except Exception:
            pass
        time.sleep(0.5)
    conn = redis.Redis.from_url(url)
    phase = ["startup"]
    mon_log = open(tmp / "monitor.log", "w")  # noqa: SIM115

    def monitor() -> None:  # every Redis command, tagged with the driver's phase
        with redis.Redis.from_url(url).monitor() as m:
            for cmd in m.listen():
                mon_log.write(f"{phase[0]}\t{cmd['client_address']}:{cmd['client_port']}\t{cmd['command'][:300]}\n")
                mon_log.flush()

    threading.Thread(target=monitor, daemon=True).start()
    for _ in range(120):  # a live worker registered
        if any(True for _ in conn.scan_iter("*worker*")):
            break
        time.sleep(0.5)
    time.sleep(3)
    sid = httpx.post(f"{base}/sessions", json={}, timeout=30).json()["session_id"]
    messages = [{"role": "user", "content": "hi"}]

    def turn() -> dict:
        r = httpx.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=60,
                       json={"model": "m", "messages": messages, "max_tokens": 8})
        r.raise_for_status()
        body = r.json()
        messages.append(body["choices"][0]["message"])
        messages.append({"role": "user", "content": "more"})
        return body

    turn()
    turn()
    time.sleep(1.0)
    for p in (serve, worker):
        _flag(p, "reset")
    time.sleep(0.3)
    t0 = time.time()
    phase[0] = "turn3"
    body = turn()
    dt = time.time() - t0
    time.sleep(1.5)  # let post-turn work (turn log, counts flush) land in this window
    for p in (serve, worker):
        _flag(p, "dump")
    time.sleep(1.0)
    phase[0] = "idle"
    print("third turn", round(dt * 1000, 1), "ms", body["choices"][0]["finish_reason"])

    # batch job: submit (traced in its own process), worker, read_rollouts (traced in-process)
    (tmp / "rollouts.jsonl").write_text(json.dumps({"id": "q1", "input_ids": [1, 2, 3],
                                                    "sampling_params": {"max_new_tokens": 8, "n": 2}}) + "\n")
    _flag(worker, "reset")
    time.sleep(0.3)
    phase[0] = "batch"
    sub = subprocess.run([py, __file__, "trace_exit", str(tmp / "submit"), "submit", str(tmp / "rollouts.jsonl"),
                          "--run", "batch1", "--output", shards, "--wait"], env=env, capture_output=True, text=True)
    print("submit rc", sub.returncode, sub.stdout[-400:], sub.stderr[-800:])
    time.sleep(1.5)
    _flag(worker, "dump")
    time.sleep(1.0)
    phase[0] = "read"
    rd = subprocess.run([py, __file__, "read", str(tmp / "read"), shards + "/batch1", url], env=env,
                        capture_output=True, text=True)
    print("read rc", rd.returncode, rd.stdout[-300:], rd.stderr[-800:])
    phase[0] = "stop"
    for p in (serve, worker):
        p.terminate()
    for p in (serve, worker):
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    server.stop()
    result = {}
    for name in ("serve.1", "worker.1", "worker.2", "submit.1", "read.1"):
        f = tmp / f"{name}.json"
        if f.exists():
            result[name] = summary(str(f))
    Path("/tmp/paths_probe/summary.json").write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(k, "files", v["files"], "threads", v["threads"])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "trace":
        sys.exit(trace(sys.argv[2], sys.argv[3:]))
    elif mode == "trace_exit":
        rec = Recorder()
        rec.install()
        from pipeline.cli.main import main
        try:
            rc = main(sys.argv[3:])
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            rec.dump(sys.argv[2] + ".1.json")
        sys.exit(rc)
    elif mode == "read":
        rec = Recorder()
        rec.install()
        import pipeline
        try:
            t = pipeline.read_rollouts(sys.argv[3])
            print("rows", t.num_rows)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            rec.dump(sys.argv[2] + ".1.json")
    else:
        drive()
