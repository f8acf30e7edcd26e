"""LoRA adapters on the engines' side: the ones an engine keeps resident (`cache`), and adapter
versions written out as PEFT directories for inference servers that load them from a path (`files`)."""
