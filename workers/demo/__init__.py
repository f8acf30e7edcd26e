"""`pipeline demo` and its model."""
