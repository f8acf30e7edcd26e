"""Intake: requests in (JSONL files, datasets, chat rendering), validated, staged and enqueued."""
