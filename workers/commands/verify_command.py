"""`pipeline verify RUN_OR_URL --model PATH`: recompute stored logprobs and gate on the mismatch."""

from __future__ import annotations

import argparse
import sys

from pipeline.core.command import EXIT_FAILED, EXIT_USAGE, Command

EXIT_EXCEEDED = EXIT_FAILED
# A check should fail loudly by default: other weights put tens of percent of tokens above 0.1
# (the demo's perturbed copy: 39.8 %), the same weights in float32 none; a bf16 engine against a
# float32 reference puts a few percent there.
DEFAULT_MAX_SHARE = 0.05


class VerifyCommand(Command):
    name = "verify"
    help = "recompute stored completion logprobs with a reference model and report the mismatch"
    connects = True

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from workers.audit.recompute import DEFAULT_MEMORY_MB, DEFAULT_THRESHOLD

        parser.add_argument("source", metavar="RUN_OR_URL",
                            help="a run name (its commit log) or a URL/directory of shards")
        parser.add_argument(
            "--model", action="append", required=True, metavar="PATH|V=PATH",
            help="the reference weights: PATH checks every token against it; V=PATH (repeat) checks the tokens "
                 "weight version V generated against PATH and leaves other versions unchecked; `demo` and "
                 "`demo-perturbed` name the demo model's directories")
        parser.add_argument("--rows", type=int, default=None, metavar="N",
                            help="a random sample of N rows (default all)")
        parser.add_argument("--seed", type=int, default=0, help="seed of the row sample (default 0)")
        parser.add_argument("--device", default="cpu", help="torch device of the reference model (default cpu)")
        parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, metavar="X",
                            help=f"report the share of tokens with |Δ logprob| above X (default {DEFAULT_THRESHOLD})")
        parser.add_argument("--max-share", type=float, default=DEFAULT_MAX_SHARE, metavar="P",
                            help="exit 1 when more than this share of the tokens differ by more than --threshold: "
                                 "other weights than the ones that generated them (default "
                                 f"{DEFAULT_MAX_SHARE:g}; 1 turns it off)")
        parser.add_argument("--max-abs-diff", type=float, default=None, metavar="X",
                            help="exit 1 when any token's |Δ logprob| exceeds X (gate a training job)")
        parser.add_argument("--worst", type=int, default=10, metavar="N", help="rows that disagree most, per group")
        parser.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB, metavar="MB",
                            help=f"logits memory per forward batch (default {DEFAULT_MEMORY_MB})")
        parser.add_argument("--store", metavar="URL",
                            help="the weight store the rows' LoRA adapters were pushed under (`pipeline weights "
                                 "push --adapter ... --store`); default <PIPELINE_HOME>/weights/<pool>")
        parser.add_argument("--json", action="store_true", help="the report as JSON")

    def run(self, args: argparse.Namespace) -> int:
        from pipeline.core.broker.connection import connect_redis
        from pipeline.core.demo_model import resolve_versioned
        from pipeline.core.shards import is_location
        from workers.audit.recompute import exceeded, verify

        report = verify(
            args.source, [resolve_versioned(model) for model in args.model], rows=args.rows, seed=args.seed,
            device=args.device, threshold=args.threshold,
            worst=args.worst, conn=None if is_location(args.source) else connect_redis(args.redis),
            memory_mb=args.memory_mb, store=args.store,
        )
        print(report.to_json() if args.json else report.format())
        if not report.tokens:
            print("error: no completion token was checked (see the skipped rows and --model V=PATH)",
                  file=sys.stderr)
            return EXIT_USAGE
        if report.share_above > args.max_share:
            print(f"verify: {report.share_above:.1%} of the tokens differ by more than {args.threshold:g} "
                  f"(--max-share {args.max_share:g}): are these the weights that generated them? (`--model V=PATH` "
                  "checks each version against its own weights)", file=sys.stderr)
            return EXIT_EXCEEDED
        if args.max_abs_diff is not None and exceeded(report, args.max_abs_diff):
            print(f"verify: max |Δ logprob| {report.max_abs_diff:.3g} exceeds --max-abs-diff {args.max_abs_diff:g}",
                  file=sys.stderr)
            return EXIT_EXCEEDED
        return 0
