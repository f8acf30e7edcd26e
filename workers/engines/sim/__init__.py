"""The `sim` engine: a simulated continuous-batching engine (`engine`) over a bounded prefix cache
(`prefix_cache`), for benchmarks and scheduling tests."""
