"""Engine adapters behind one `Engine` protocol (`base`): hf, sglang, sglang-http, vllm-http, sim."""
