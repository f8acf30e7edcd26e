"""What the trainer side and the workers both stand on: it imports neither of them.

Redis (`broker`: connections, key names, the control channel, the commit and reward logs, the
worker registry), the RQ job contract (`jobs`), settings, errors, storage through fsspec, reading
shards, the weight store (`weights`), and the command base class both sides' CLI commands
implement. `workers` imports only this package and `schemas`; the rest of `pipeline` (the
trainer's side) imports it too, and nothing here imports either (`tests/test_layers.py` holds it).
"""
