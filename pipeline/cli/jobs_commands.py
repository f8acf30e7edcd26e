"""`pipeline submit` and `pipeline cancel`: put a run's jobs on the queue, take them off."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.core.command import Command
from pipeline.core.errors import PipelineError
from pipeline.core.suggest import missing_file

_DEFAULT = "default for every line or row that does not set it"
# Sampling flags of `pipeline submit`: defaults for every row of a dataset or line of a JSONL file (a row's
# own columns, a line's own sampling_params, win).
_SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids")


class SubmitCommand(Command):
    name = "submit"
    help = "validate a JSONL file or a dataset of requests and enqueue all of it"
    connects = True
    pool_use = "names"

    def new_pool(self, pool: str) -> None:
        print(f"note: pool {pool!r} is new: no worker serves it yet (`pipeline worker --pool {pool}`)", file=sys.stderr)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add = parser.add_argument
        add("file", help="a JSONL file of request lines, or a dataset: .parquet, .arrow, .feather, a "
                         "directory of Parquet files or one written by datasets' save_to_disk")
        add("--column", action="append", default=[], metavar="FIELD=COLUMN",
            help="dataset: the column holding a request field, e.g. input_ids=prompt_ids, "
                 "messages=prompt, id=uid, temperature=temp (dotted paths into struct columns); "
                 "repeatable")
        add("--metadata", action="append", default=[], metavar="KEY=COLUMN",
            help="dataset: a metadata key from a column, e.g. answer=reward_model.ground_truth; "
                 "repeatable")
        add("--max-new-tokens", dest="max_new_tokens", type=int, help=_DEFAULT)
        add("--temperature", type=float, help=_DEFAULT)
        add("--top-p", dest="top_p", type=float, help=_DEFAULT)
        add("--top-k", dest="top_k", type=int, help=_DEFAULT)
        add("--min-p", dest="min_p", type=float, help=_DEFAULT)
        add("--n", type=int, help="samples per prompt, for every line or row that does not set it")
        add("--seed", type=int, help="sampling seed, for every line or row that does not set it")
        add("--stop", action="append", default=None,
            help="a stop string, for every line or row that sets none; repeatable")
        add("--stop-token-id", dest="stop_token_ids", action="append", type=int, default=None,
            help="a stop token id, for every line or row that sets none; repeatable")
        add("--run", default=None, help="run name (default: a new timestamped one)")
        add("--output", default=None,
            help="fsspec URL for shards (default: $PIPELINE_OUTPUT or the state dir)")
        add("--batch-size", type=int, default=64, help="requests per job (default 64)")
        add("--min-weight-version", type=int, default=None)
        add("--max-staleness", type=int, default=None, metavar="K",
            help="no committed sample keeps a token from a weight version more than K behind its "
                 "worker's at commit; one that would is generated again from the start (partial swaps)")
        add("--reward", metavar="NAME", default=None,
            help="a registered reward function (built-ins: exact_match, numeric_match) that reward "
                 "workers run on every committed shard")
        add("--groups", type=int, default=None, metavar="N",
            help="submit only the first N requests (with --oversample F: ceil(N x F)); `batch.take()` "
                 "keeps N groups")
        add("--oversample", type=float, default=None, metavar="F",
            help="submit F times the --groups requests, so N groups survive a filter in one round")
        add("--vocab-size", type=int, default=None, help="reject token ids >= this")
        add("--tokenizer", metavar="PATH", default=None,
            help="render `messages`/`prompt` lines (or columns) into token ids with this tokenizer (as "
                 "SGLang would); `demo`: the demo model's")
        episodes = parser.add_argument_group(
            "agent episodes", "with --agent, the file holds tasks (JSON objects; `id` names one) and each task x "
            "sample is an episode job that `pipeline agent-worker` runs")
        episodes.add_argument("--agent", metavar="MODULE:FUNCTION", default=None,
                              help="the agent: async def solve(task, client, episode) -> reward (imported here "
                                   "first; agent workers must be started with it)")
        episodes.add_argument("--episode-timeout", type=float, default=None, metavar="S",
                              help="seconds an attempt may take (default 600)")
        episodes.add_argument("--max-turns", type=int, default=None, metavar="N",
                              help="model calls an episode may make (default: no limit)")
        episodes.add_argument("--retries", type=int, default=None, metavar="R",
                              help="attempts after the first for an episode that raises or times out (default 2)")
        episodes.add_argument("--failed-reward", type=float, default=None, metavar="X",
                              help="train on failed episodes with this reward (default: they are left out)")
        episodes.add_argument("--groups-per-step", type=int, default=None, metavar="B",
                              help="with --max-staleness K: tasks a training step takes; step s's tasks start "
                                   "once the trainer has pushed the version K steps before it")
        episodes.add_argument("--adapter", metavar="NAME", default=None,
                              help="every turn of every episode runs on this LoRA adapter of the pool "
                                   "(`pipeline weights push --adapter NAME DIR`)")
        add("--wait", action="store_true", help="follow the jobs; exit non-zero if any fails")
        add("--timeout", type=float, default=None, help="seconds to --wait (default: forever)")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.client import connect
        from pipeline.core.demo_model import resolve

        if not Path(args.file).exists():  # before anything starts (the embedded Redis)
            from pipeline.submit.dataset_source import DATASET_KINDS

            raise PipelineError(missing_file(Path(args.file), "a JSONL file of tasks" if args.agent else
                                             f"a JSONL file of requests or {DATASET_KINDS}"))
        client = connect(args.redis, pool=args.pool)
        if args.agent is not None:
            return self._episodes(client, args)
        episode_only = [flag for flag, value in (("--episode-timeout", args.episode_timeout),
                                                 ("--max-turns", args.max_turns), ("--retries", args.retries),
                                                 ("--failed-reward", args.failed_reward),
                                                 ("--groups-per-step", args.groups_per_step),
                                                 ("--adapter", args.adapter)) if value is not None]
        if episode_only:
            raise PipelineError(f"{', '.join(episode_only)} apply to agent episodes: add --agent MODULE:FUNCTION")
        mapping: dict[str, Any] = {}
        sampling = {name: value for name, value in vars(args).items()
                    if name in _SAMPLING_FLAGS and value is not None}
        if args.column or args.metadata or sampling:
            from pipeline.submit.dataset_input import ColumnMapping
            from pipeline.submit.dataset_source import is_dataset_path

            if not is_dataset_path(args.file):
                if args.column or args.metadata:
                    raise PipelineError("--column and --metadata apply to a dataset (Parquet, Arrow, Feather or a "
                                        "directory of them); JSONL lines name their own fields")
                mapping = {"sampling": sampling}  # defaults for the lines that do not set them
            else:
                parsed = ColumnMapping.parse(args.column, args.metadata, sampling)
                mapping = {"columns": parsed.columns, "metadata": parsed.metadata, "sampling": parsed.sampling}
        batch = client.submit_file(
            args.file,
            **mapping,
            tokenizer=resolve(args.tokenizer) if args.tokenizer else None,
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


    def _episodes(self, client: Any, args: argparse.Namespace) -> int:
        not_for_episodes = [flag for flag, value in (
            ("--column", args.column), ("--metadata", args.metadata), ("--tokenizer", args.tokenizer),
            ("--reward", args.reward), ("--groups", args.groups), ("--oversample", args.oversample),
            ("--min-weight-version", args.min_weight_version), ("--vocab-size", args.vocab_size),
            *((f"--{name.replace('_', '-')}", getattr(args, name)) for name in _SAMPLING_FLAGS if name != "n"))
            if value]
        if not_for_episodes:
            raise PipelineError(f"{', '.join(not_for_episodes)} do not apply to agent episodes (the agent makes its "
                                "own calls); nothing was enqueued")
        from schemas.episode import DEFAULT_EPISODE_RETRIES, DEFAULT_EPISODE_TIMEOUT_S

        run = client.submit_episodes(
            args.file, agent=args.agent, run=args.run, n=args.n or 1,
            timeout_s=args.episode_timeout or DEFAULT_EPISODE_TIMEOUT_S, max_turns=args.max_turns,
            retries=DEFAULT_EPISODE_RETRIES if args.retries is None else args.retries,
            failed_reward=args.failed_reward, max_staleness=args.max_staleness, groups_per_step=args.groups_per_step,
            adapter=args.adapter)
        plan = run.plan
        print(f"run: {plan.run} (pool {plan.pool})")
        print(f"episodes: {plan.episodes} ({len(plan.tasks)} tasks x {plan.n}) for agent {plan.agent}")
        print(f"run them: pipeline agent-worker --agent {plan.agent}" + (f" --pool {plan.pool}"
                                                                        if plan.pool != "default" else ""))
        if args.wait:
            counts = run.wait(timeout=args.timeout)
            print(f"done: {counts['finished']} finished, {counts['failed']} failed")
            return 1 if counts["failed"] else 0
        return 0


class CancelCommand(Command):
    name = "cancel"
    help = "cancel a run or jobs: queued ones removed, running ones aborted"
    connects = True
    pool_use = "reads"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--run", default=None, help="every job submitted to this run")
        parser.add_argument("job_ids", nargs="*", metavar="JOB_ID", help="jobs to cancel (`Batch.job_ids`)")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.client import connect
        from pipeline.core.broker import registry
        from pipeline.core.errors import UnknownRunError
        from pipeline.core.suggest import did_you_mean, listing

        client = connect(args.redis, pool=args.pool)
        known = registry.runs(client.conn)
        if args.run is None and args.job_ids:
            runs = set(known).intersection(args.job_ids)
            if runs:
                name = sorted(runs)[0]
                raise PipelineError(f"{name!r} is a run, not a job id: `pipeline cancel --run {name}`; nothing was "
                                    "canceled")
        if args.run is not None and args.run not in known:
            raise UnknownRunError(f"no run {args.run!r} in this Redis; runs here: {listing(known)}"
                                  f"{did_you_mean(args.run, known)}; nothing was canceled")
        result = client.cancel(args.run, job_ids=args.job_ids, pool=args.pool)
        if result.job_ids or not result.episodes:
            print(f"canceled {result.canceled} of {len(result.job_ids)} job(s): {result.queued} removed from the "
                  f"queue, {result.running} aborted in flight; left as they were: {result.finished} finished, "
                  f"{result.failed} failed, {result.already} canceled before")
        if result.episodes or (args.run and not result.job_ids):
            print(f"canceled {result.episodes} episode(s) of run {args.run} that had not ended (those in flight stop "
                  "within seconds; finished ones stay)")
        return 0
