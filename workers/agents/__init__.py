"""Agent episodes on CPU: `pipeline agent-worker` (`worker`) runs the episodes `pipeline submit --agent`
queued, each attempt in a fresh session of `pipeline serve` (`attempt`, `serve_client`), started
within the run's staleness budget (`admission`), traced (`tracing`)."""
