"""The trainer's side of the rollout pipeline and the shared plumbing.

    import pipeline
    client = pipeline.connect()
    batch = client.submit(requests, run="step-42")
    batch.wait(timeout=600)
    table = batch.read()

Importing this package never imports torch, transformers or sglang. Module paths of earlier
releases (`pipeline.torch_data`, `pipeline.take`, ...) still import (`pipeline.moved`).
"""

from pipeline import moved
from pipeline.audit.report import report
from pipeline.audit.verify import verify
from pipeline.client import Client, connect
from pipeline.core.errors import (
    APIError,
    CapabilityError,
    ColumnMappingError,
    ControlAuthError,
    CorruptDeltaError,
    DatasetError,
    EmbeddedRedisError,
    IncompleteBatchError,
    JobsFailedError,
    LineError,
    ManifestError,
    NoShardsError,
    PipelineError,
    PolicyError,
    PoolNameError,
    RedisURLError,
    RenderError,
    RequestFileError,
    RewardNameError,
    RowError,
    SafetensorsError,
    StoreError,
    SubmitLostError,
    UnknownRunError,
    WaitTimeoutError,
    WeightPushError,
    WeightsMismatchError,
    WeightStoreError,
    WeightVersionError,
    WriteLostError,
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
from pipeline.read.trajectories import read_trajectories
from pipeline.runs.batch import Batch

moved.install()

__all__ = [
    "APIError",
    "Batch",
    "CapabilityError",
    "Client",
    "ColumnMappingError",
    "ControlAuthError",
    "CorruptDeltaError",
    "DatasetError",
    "EmbeddedRedisError",
    "IncompleteBatchError",
    "JobsFailedError",
    "LineError",
    "ManifestError",
    "NoShardsError",
    "PipelineError",
    "PolicyError",
    "PoolNameError",
    "RedisURLError",
    "RenderError",
    "RequestFileError",
    "RewardNameError",
    "RowError",
    "SafetensorsError",
    "StoreError",
    "SubmitLostError",
    "UnknownRunError",
    "VerifyReport",
    "WaitTimeoutError",
    "WeightPushError",
    "WeightStoreError",
    "WeightVersionError",
    "WeightsMismatchError",
    "WriteLostError",
    "connect",
    "finish_reason_in",
    "read_rollouts",
    "read_trajectories",
    "report",
    "request_id_in",
    "rollouts_dataset",
    "routed_experts",
    "routed_experts_positions",
    "verify",
    "weight_version_between",
]
