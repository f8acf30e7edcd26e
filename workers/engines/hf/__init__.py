"""The `hf` engine: transformers on CPU or GPU."""
