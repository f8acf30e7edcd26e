"""Submitting requests: JSONL files (`request_file`), datasets (`dataset_input`, `dataset_source`) and
chat messages rendered to token ids (`render`), validated, placed by what they need of a worker
(`placement`), their prompt ids staged (`prompt_staging`), ids kept unique in a run (`run_ids`), and
enqueued all or nothing (`enqueue`)."""
