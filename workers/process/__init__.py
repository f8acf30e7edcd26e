"""The worker process: the RQ worker around one engine, heartbeats, control follower, health, logs, metrics."""
