"""SGLang engines: in-process (`sglang`) and over HTTP (`sglang-http`, servers or the gateway)."""
