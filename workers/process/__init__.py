"""The worker process: the RQ worker around one engine, heartbeat and registry, control follower, job intake,
health, logs, metrics."""
