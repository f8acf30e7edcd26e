"""The `pipeline` command line.

Every command that talks to Redis takes `--redis URL` (default `$PIPELINE_REDIS_URL`, else the
embedded server) and `--pool NAME` (default `$PIPELINE_POOL`, else `default`; `status` without
either lists every pool).
Commands that need the GPU side (`worker`, `demo`) are contributed by the `workers` package
through the `pipeline.commands` entry point group, so `pipeline` never imports `workers`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

import redis

from pipeline import settings
from pipeline.errors import (
    JobsFailedError,
    NoShardsError,
    PipelineError,
    UnknownRunError,
    WaitTimeoutError,
    WeightPushError,
)
from schemas.control import SWAP_MODES

# Exit codes (README "Exit codes"): scripts and orchestrators tell these apart.
EXIT_FAILED = 1  # jobs failed, a worker failed to load pushed weights, nothing to show
EXIT_USAGE = 2  # bad arguments or input: invalid lines, refused URL or path, missing file (argparse too)
EXIT_TIMEOUT = 3  # a wait or a weight push ran out of time (the work may still finish)
EXIT_UNREACHABLE = 4  # Redis could not be reached; nothing was done
EXIT_INTERRUPTED = 130


def exit_code(exc: BaseException) -> int:
    """The exit code for an error that ended a command."""
    if isinstance(exc, WeightPushError):
        return EXIT_TIMEOUT if exc.timed_out and not exc.failed else EXIT_FAILED
    if isinstance(exc, JobsFailedError | NoShardsError | UnknownRunError):
        return EXIT_FAILED
    if isinstance(exc, WaitTimeoutError):
        return EXIT_TIMEOUT
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return EXIT_UNREACHABLE
    return EXIT_USAGE


def _add_redis(parser: argparse.ArgumentParser) -> None:
    """The connection options: `--redis URL` and `--pool NAME`."""
    parser.add_argument("--redis", metavar="URL", default=None,
                        help="Redis URL (default: $PIPELINE_REDIS_URL, else the embedded server)")
    parser.add_argument("--pool", metavar="NAME", default=None,
                        help="the pool: its own queue, workers and control state (default: $PIPELINE_POOL, "
                             "else 'default')")


# Sampling flags of `pipeline submit`: defaults for every row of a dataset (a row's own columns win).
_SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids")


def _cmd_submit(args: argparse.Namespace) -> int:
    from pipeline.client import connect

    client = connect(args.redis, pool=args.pool)
    mapping: dict[str, Any] = {}
    sampling = {name: value for name, value in vars(args).items() if name in _SAMPLING_FLAGS and value is not None}
    if args.column or args.metadata or sampling:
        from pipeline.intake.dataset_input import ColumnMapping
        from pipeline.intake.dataset_source import is_dataset_path

        if not is_dataset_path(args.file):
            raise PipelineError("--column, --metadata and the sampling flags apply to a dataset (Parquet, Arrow, "
                                "Feather or a directory of them); JSONL lines give their own fields")
        parsed = ColumnMapping.parse(args.column, args.metadata, sampling)
        mapping = {"columns": parsed.columns, "metadata": parsed.metadata, "sampling": parsed.sampling}
    batch = client.submit_file(
        args.file,
        **mapping,
        tokenizer=args.tokenizer or None,
        vocab_size=args.vocab_size,
        run=args.run,
        output=args.output,
        batch_size=args.batch_size,
        min_weight_version=args.min_weight_version,
        max_staleness=args.max_staleness,
        reward=args.reward,
        groups=args.groups,
        oversample=args.oversample,
    )
    plan = batch.plan
    print(f"run: {plan.run} (pool {plan.pool})")
    print(f"requests: {plan.requests} ({plan.samples} samples) in {len(plan.job_ids)} jobs")
    print(f"output: {batch.url}")
    if args.wait:
        status = batch.wait(timeout=args.timeout, progress=True)
        print(f"done: {status.counts['finished']} jobs, {batch.committed_rows()} rows")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from pipeline.audit.status import collect, format_status
    from pipeline.broker.connection import connect_redis

    status = collect(connect_redis(args.redis), run=args.run, pool=args.pool or settings.pool())
    print(json.dumps(status, indent=2, default=str) if args.json else format_status(status))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from pipeline.audit.display import format_rows, rows_as_json
    from pipeline.read.reader import read_rollouts

    table = read_rollouts(args.url)
    if args.limit is not None:
        table = table.slice(0, args.limit)
    if table.num_rows == 0:
        print(f"no rows under {args.url}", file=sys.stderr)
        return EXIT_FAILED
    print(rows_as_json(table, token_ids=args.token_ids) if args.json
          else format_rows(table, token_ids=args.token_ids))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pipeline.audit.report import report
    from pipeline.broker.connection import connect_redis
    from pipeline.read.reader import is_location

    page = report(args.source, conn=None if is_location(args.source) else connect_redis(args.redis),
                  verify_model=args.verify_model, verify_options={"rows": args.verify_rows})
    with open(args.out, "w", encoding="utf-8") as out:
        out.write(page)
    print(f"wrote {args.out} ({len(page) // 1024} KiB)")
    return 0


def _cmd_pause(args: argparse.Namespace) -> int:
    from pipeline.client import connect

    client = connect(args.redis, pool=args.pool)
    state = client.pause()
    print(f"pool {client.pool}: paused (generation {state.generation})")
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from pipeline.client import connect

    client = connect(args.redis, pool=args.pool)
    state = client.resume()
    print(f"pool {client.pool}: resumed (generation {state.generation})")
    return 0


def _cmd_weights_push(args: argparse.Namespace) -> int:
    from pipeline.client import connect

    client = connect(args.redis, pool=args.pool)
    result = client.push_weights(args.path, version=args.version, timeout=args.timeout, force=args.force,
                                 mode=args.mode)
    print(f"pool {client.pool}: weights v{result.version} from {result.path} ({args.mode}): {len(result.acks)} "
          f"worker(s) acknowledged in {result.seconds:.2f} s")
    for ack in result.acks:
        # A worker whose engine cannot stop samples drains instead of a partial swap, and says so.
        print(f"  {ack.worker}: ok ({ack.seconds:.2f} s, {ack.mode})")
    return 0


def _cmd_weights_status(args: argparse.Namespace) -> int:
    from pipeline.audit.status import format_weights, weights
    from pipeline.broker.connection import connect_redis

    status = weights(connect_redis(args.redis), pool=args.pool or settings.pool())
    print(json.dumps(status, indent=2) if args.json else format_weights(status))
    return 0 if all(w["converged"] for w in status["workers"]) else EXIT_FAILED


def _cmd_cancel(args: argparse.Namespace) -> int:
    from pipeline.client import connect

    client = connect(args.redis, pool=args.pool)
    result = client.cancel(args.run, job_ids=args.job_ids, pool=args.pool)
    print(f"canceled {len(result.job_ids)} job(s): {result.queued} removed from the queue, {result.running} "
          f"aborted in flight; left as they were: {result.finished} finished, {result.failed} failed, "
          f"{result.already} canceled before")
    return 0


def _cmd_redis(args: argparse.Namespace) -> int:
    from pipeline.broker.redis_server import embedded_server

    server = embedded_server()
    if args.action == "start":
        print(server.ensure_started())
    elif args.action == "url":
        print(server.url if server.is_running() else "not running")
    elif args.action == "stop":
        print("stopped" if server.stop() else "not running")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline", description="Token-exact LLM rollouts over Redis/RQ into Parquet."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="validate a JSONL file or a dataset of requests and enqueue all of it")
    _add_redis(p)
    p.add_argument("file", help="a JSONL file of request lines, or a dataset: .parquet, .arrow, .feather, a directory "
                                "of Parquet files or one written by datasets' save_to_disk")
    p.add_argument("--column", action="append", default=[], metavar="FIELD=COLUMN",
                   help="dataset: the column holding a request field, e.g. input_ids=prompt_ids, messages=prompt, "
                        "id=uid, temperature=temp (dotted paths into struct columns); repeatable")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=COLUMN",
                   help="dataset: a metadata key from a column, e.g. answer=reward_model.ground_truth; repeatable")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, help="dataset: default for every row")
    p.add_argument("--temperature", type=float, help="dataset: default for every row")
    p.add_argument("--top-p", dest="top_p", type=float, help="dataset: default for every row")
    p.add_argument("--top-k", dest="top_k", type=int, help="dataset: default for every row")
    p.add_argument("--min-p", dest="min_p", type=float, help="dataset: default for every row")
    p.add_argument("--n", type=int, help="dataset: samples per prompt for every row")
    p.add_argument("--seed", type=int, help="dataset: sampling seed for every row")
    p.add_argument("--stop", action="append", default=None, help="dataset: a stop string for every row; repeatable")
    p.add_argument("--stop-token-id", dest="stop_token_ids", action="append", type=int, default=None,
                   help="dataset: a stop token id for every row; repeatable")
    p.add_argument("--run", default=None, help="run name (default: a new timestamped one)")
    p.add_argument("--output", default=None, help="fsspec URL for shards (default: $PIPELINE_OUTPUT or the state dir)")
    p.add_argument("--batch-size", type=int, default=64, help="requests per job (default 64)")
    p.add_argument("--min-weight-version", type=int, default=None)
    p.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="no committed sample keeps a token from a weight version more than K behind its worker's "
                        "at commit; one that would is generated again from the start (partial swaps)")
    p.add_argument("--reward", metavar="NAME", default=None,
                   help="a registered reward function (built-ins: exact_match, numeric_match) that reward "
                        "workers run on every committed shard")
    p.add_argument("--groups", type=int, default=None, metavar="N",
                   help="submit only the first N requests (with --oversample F: ceil(N x F)); `batch.take()` "
                        "keeps N groups")
    p.add_argument("--oversample", type=float, default=None, metavar="F",
                   help="submit F times the --groups requests, so N groups survive a filter in one round")
    p.add_argument("--vocab-size", type=int, default=None, help="reject token ids >= this")
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="render `messages`/`prompt` lines (or columns) into token ids with this tokenizer (as SGLang "
                        "would)")
    p.add_argument("--wait", action="store_true", help="follow the jobs; exit non-zero if any fails")
    p.add_argument("--timeout", type=float, default=None, help="seconds to --wait (default: forever)")
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser("status", help="per pool: queue, workers, weight versions, runs, failures")
    _add_redis(p)
    p.add_argument("--run", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("show", help="print the rows of a run directory or shard")
    p.add_argument("url")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--token-ids", action="store_true", help="render tokens as token_id:<id> (display only)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("report", help="one self-contained HTML page of a run: lengths, finishes, logprobs, "
                                      "workers, throughput, staleness, verify")
    _add_redis(p)
    p.add_argument("source", metavar="RUN_OR_URL", help="a run name (its commit log) or a URL/directory of shards")
    p.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    p.add_argument("--verify-model", action="append", default=None, metavar="PATH|V=PATH",
                   help="also run `pipeline verify` with this model (as verify's --model) and show its summary")
    p.add_argument("--verify-rows", type=int, default=None, metavar="N", help="verify a random sample of N rows")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("cancel", help="cancel a run or jobs: queued ones removed, running ones aborted")
    _add_redis(p)
    p.add_argument("--run", default=None, help="every job submitted to this run")
    p.add_argument("job_ids", nargs="*", metavar="JOB_ID", help="jobs to cancel (`Batch.job_ids`)")
    p.set_defaults(func=_cmd_cancel)

    p = sub.add_parser("pause", help="workers finish the batch in hand and take no new job")
    _add_redis(p)
    p.set_defaults(func=_cmd_pause)

    p = sub.add_parser("resume", help="workers take jobs again")
    _add_redis(p)
    p.set_defaults(func=_cmd_resume)

    p = sub.add_parser("weights", help="weight versions served by the workers")
    weights = p.add_subparsers(dest="weights_command", required=True)
    p = weights.add_parser("push", help="make every worker load new weights; wait for all acknowledgements")
    _add_redis(p)
    p.add_argument("path", help="checkpoint directory, as the workers see it")
    p.add_argument("--version", type=int, required=True, help="the new weight version (newer than the current)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for acknowledgements (default 600)")
    p.add_argument("--force", action="store_true",
                   help="allow a version not newer than the current one; also makes workers that failed to "
                        "load the current weights try again (recovery: re-push the same path and version)")
    p.add_argument("--mode", choices=SWAP_MODES, default="drain",
                   help="drain (default): samples in flight finish on the old weights first; partial: they "
                        "stop at the next step and continue on the new weights, each token keeping its version")
    p.set_defaults(func=_cmd_weights_push)
    p = weights.add_parser("status", help="the pool's desired weights and each live worker's; exit 1 if any "
                                          "worker does not serve them")
    _add_redis(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_weights_status)

    p = sub.add_parser("redis", help="the embedded Redis server")
    p.add_argument("action", choices=["start", "stop", "url"])
    p.set_defaults(func=_cmd_redis)

    for entry in entry_points(group="pipeline.commands"):
        register = entry.load()
        register(sub, _add_redis)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exit_code(exc)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print(f"error: cannot reach Redis ({exc}); start the embedded one with `pipeline redis start`, "
              "or pass --redis URL / set PIPELINE_REDIS_URL; nothing was done", file=sys.stderr)
        return exit_code(exc)
    except OSError as exc:  # a file named on the command line
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
