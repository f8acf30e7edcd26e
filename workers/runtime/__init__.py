"""The worker process's plumbing every other part of `workers` uses: logging that names the job
(`logs`), retry backoff (`backoff`), and threads that tick on an interval (`periodic`)."""
