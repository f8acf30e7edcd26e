"""Jobs on the worker: the allow-listed job function, admission, feeding the engine, hand-backs, reconciliation."""
