"""Versioned weight stores, as both sides read them.

`store.WeightStore` is the layout at an fsspec URL (full versions as bucketed safetensors, the
versions between them as per-tensor deltas with a checksum of every resulting tensor); `codec`
encodes a tensor's change; `manifest` lists a version's tensors; `materialise` rebuilds a version
from the store. Writing a version from a trainer's memory is the trainer's side
(`pipeline.weights.writer`, `pipeline.weights.push`).
"""
