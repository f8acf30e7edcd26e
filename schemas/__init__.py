"""Data contracts shared by the trainer side (`pipeline`) and the GPU side (`workers`).

Imports nothing from either of them.
"""

from schemas.job_payload import JobPayload
from schemas.request import RolloutRequest, SamplingParams
from schemas.shard import SCHEMA_VERSION, SHARD_SCHEMA, shard_schema

__all__ = [
    "SCHEMA_VERSION",
    "SHARD_SCHEMA",
    "JobPayload",
    "RolloutRequest",
    "SamplingParams",
    "shard_schema",
]
