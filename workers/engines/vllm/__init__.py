"""The `vllm-http` engine: vLLM servers over `/v1/completions` with token ids."""
