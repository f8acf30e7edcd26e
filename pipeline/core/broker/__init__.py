"""The broker: Redis connections, key names, replication, control channel, commit and reward logs, registry."""
