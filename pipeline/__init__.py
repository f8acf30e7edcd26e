"""The trainer's side of the rollout pipeline: submit, wait, read, push weights.

    import pipeline
    client = pipeline.connect()
    batch = client.submit(requests, run="step-42")
    batch.wait(timeout=600)
    table = batch.read()

The names below are the public API; each is imported on first use (PEP 562), so `import pipeline`
loads nothing else, a worker importing `pipeline.core` pays for none of the trainer's side, and
`import pipeline` never imports torch, transformers or sglang (`RolloutBatches` and the TRL glue
do when first used). Modules under `pipeline.*` are internal: their paths may change between
releases (docs/changelog.md lists the moves); the names here do not.

The packages: `core` (what trainers and workers both stand on: Redis, the job contract, settings,
errors, storage, shards, the weight store), `submit`, `runs` (a submitted run's handle, take,
cancel), `read` (into training), `audit` (status, verify, report), `serve` (the agent endpoint),
`weights` (pushing from the trainer), `integrations` (TRL), `cli`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name → the module that defines it.
_EXPORTS = {
    # connecting, submitting, the handle of a submitted batch
    "Client": "pipeline.client",
    "connect": "pipeline.client",
    "Batch": "pipeline.runs.batch",
    "ChatRenderer": "pipeline.submit.render",
    # reading into training
    "read_rollouts": "pipeline.core.shards",
    "rollouts_dataset": "pipeline.core.shards",
    "finish_reason_in": "pipeline.core.shards",
    "request_id_in": "pipeline.core.shards",
    "weight_version_between": "pipeline.core.shards",
    "read_trajectories": "pipeline.read.trajectories",
    "routed_experts": "pipeline.core.routed_experts",
    "routed_experts_positions": "pipeline.core.routed_experts",
    "rewards_differ": "pipeline.runs.take",
    "RolloutBatches": "pipeline.read.torch_data",
    # weights from a trainer's memory, TRL
    "push_model": "pipeline.integrations.push",
    "push_adapter": "pipeline.integrations.push",
    "pipeline_rollout": "pipeline.integrations.trl",
    # checking what was generated
    "verify": "pipeline.audit.verify",
    "VerifyReport": "pipeline.core.verify_stats",
    "report": "pipeline.audit.report",
    # the errors a caller of the names above catches
    "PipelineError": "pipeline.core.errors",
    "RequestFileError": "pipeline.core.errors",
    "DatasetError": "pipeline.core.errors",
    "RenderError": "pipeline.core.errors",
    "CapabilityError": "pipeline.core.errors",
    "SubmitLostError": "pipeline.core.errors",
    "UnknownRunError": "pipeline.core.errors",
    "NoShardsError": "pipeline.core.errors",
    "JobsFailedError": "pipeline.core.errors",
    "WaitTimeoutError": "pipeline.core.errors",
    "IncompleteBatchError": "pipeline.core.errors",
    "WeightPushError": "pipeline.core.errors",
    "WeightVersionError": "pipeline.core.errors",
    "WeightStoreError": "pipeline.core.errors",
    "AdapterError": "pipeline.core.errors",
}

__all__ = [
    "AdapterError",
    "Batch",
    "CapabilityError",
    "ChatRenderer",
    "Client",
    "DatasetError",
    "IncompleteBatchError",
    "JobsFailedError",
    "NoShardsError",
    "PipelineError",
    "RenderError",
    "RequestFileError",
    "RolloutBatches",
    "SubmitLostError",
    "UnknownRunError",
    "VerifyReport",
    "WaitTimeoutError",
    "WeightPushError",
    "WeightStoreError",
    "WeightVersionError",
    "connect",
    "finish_reason_in",
    "pipeline_rollout",
    "push_adapter",
    "push_model",
    "read_rollouts",
    "read_trajectories",
    "report",
    "request_id_in",
    "rewards_differ",
    "rollouts_dataset",
    "routed_experts",
    "routed_experts_positions",
    "verify",
    "weight_version_between",
]  # the keys of _EXPORTS (tests/pipeline/test_public_api.py)

if TYPE_CHECKING:  # what a type checker and an IDE see; nothing of it runs
    from pipeline.audit.report import report
    from pipeline.audit.verify import verify
    from pipeline.client import Client, connect
    from pipeline.core.errors import (
        AdapterError,
        CapabilityError,
        DatasetError,
        IncompleteBatchError,
        JobsFailedError,
        NoShardsError,
        PipelineError,
        RenderError,
        RequestFileError,
        SubmitLostError,
        UnknownRunError,
        WaitTimeoutError,
        WeightPushError,
        WeightStoreError,
        WeightVersionError,
    )
    from pipeline.core.routed_experts import routed_experts, routed_experts_positions
    from pipeline.core.shards import (
        finish_reason_in,
        read_rollouts,
        request_id_in,
        rollouts_dataset,
        weight_version_between,
    )
    from pipeline.core.verify_stats import VerifyReport
    from pipeline.integrations.push import push_adapter, push_model
    from pipeline.integrations.trl import pipeline_rollout
    from pipeline.read.torch_data import RolloutBatches
    from pipeline.read.trajectories import read_trajectories
    from pipeline.runs.batch import Batch
    from pipeline.runs.take import rewards_differ
    from pipeline.submit.render import ChatRenderer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
