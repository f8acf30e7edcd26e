"""The GPU side of the rollout pipeline: worker processes, engine adapters, contracts, shards.

Depends on `pipeline` and `schemas`, never the other way round.
"""
