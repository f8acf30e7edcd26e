"""Smoke test of the in-process `sglang` engine on a machine with SGLang and a GPU.

Runs a few chat prompts of a real small model through `workers.engines.sglang.engine`,
builds shard rows with the same contracts as every engine, checks the invariants, and
compares greedy outputs with the `hf` engine on the same model (same token ids expected for
the first tokens; logprobs close). Not part of the test suite: no GPU there.

    pip install -e '.[hf,sglang]'
    python scripts/sglang_smoke.py --model /path/to/hf-model-dir [--mem-fraction 0.5]
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime

import numpy as np

from schemas.request import RolloutRequest
from workers.engines.hf.engine import HFEngine
from workers.engines.sglang.engine import SGLangEngine
from workers.rows.table import RowContext, build_table

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a transformers model directory")
    parser.add_argument("--mem-fraction", type=float, default=0.5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    hf = HFEngine(args.model, device="cuda", max_top_logprobs=5)
    tokenizer = hf.tokenizer
    requests = []
    for i, question in enumerate(QUESTIONS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_dict=False)
        requests.append(RolloutRequest(id=f"greedy{i}", input_ids=list(ids), logprobs=5, prompt_logprobs=0,
                                       sampling_params={"max_new_tokens": args.max_new_tokens, "temperature": 0.0}))
        requests.append(RolloutRequest(id=f"sampled{i}", input_ids=list(ids),
                                       sampling_params={"max_new_tokens": args.max_new_tokens, "n": 4, "seed": i,
                                                        "stop": ["\n\n"]}))

    engine = SGLangEngine(args.model, max_top_logprobs=5,
                          engine_args={"mem_fraction_static": args.mem_fraction})
    now = datetime.now(UTC)
    ctx = RowContext(run="smoke", job_id="smoke", engine="sglang", model=args.model, worker_id="smoke",
                     weight_version=engine.weight_version, submitted_at=now, started_at=now, finished_at=now)
    rows = build_table(requests, engine.generate(requests), ctx).to_pylist()  # contract checks run here
    reference = {r["rollout_id"]: r for r in build_table(
        requests, hf.generate(requests), ctx).to_pylist()}
    problems = 0
    for row in rows:
        print(f"{row['rollout_id']:<12} {row['finish_reason']:<6} {row['completion_tokens']:>3} tokens: "
              f"{(row['completion_text'] or '')[:70]!r}")
        if row["request_id"].startswith("greedy"):
            ref = reference[row["rollout_id"]]
            head = min(8, len(ref["completion_token_ids"]), len(row["completion_token_ids"]))
            same = row["completion_token_ids"][:head] == ref["completion_token_ids"][:head]
            gap = float(np.max(np.abs(np.array(row["completion_logprobs"][:head])
                                      - np.array(ref["completion_logprobs"][:head])))) if head else 0.0
            print(f"    vs hf: first {head} tokens {'equal' if same else 'DIFFER'}, max logprob gap {gap:.3f}")
            problems += (not same) + (gap > 0.1)
    engine.close()
    print("OK" if problems == 0 else f"{problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
