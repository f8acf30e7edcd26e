"""The subcommands the GPU side contributes to `pipeline` (worker, reward-worker, verify, demo)."""
