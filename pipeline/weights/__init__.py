"""Pushing weights from the trainer: a state dict or checkpoint directory written into the weight
store as the next version (`writer`), and the push that tells every worker to load it (`push`).
The store's layout, which workers read too, is `pipeline.core.weights`.
"""
