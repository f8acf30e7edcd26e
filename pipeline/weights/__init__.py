"""Versioned weight stores: pushes from a trainer's memory, as deltas, applied in place by workers.

`store.WeightStore` is the layout at an fsspec URL (full versions as bucketed safetensors, the
versions between them as per-tensor deltas with a checksum of every resulting tensor);
`codec` encodes a tensor's change; `writer` turns a state dict or a checkpoint directory into
the next version; `inplace` (torch side) applies versions to a model's tensors and checks them.
"""
