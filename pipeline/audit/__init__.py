"""Seeing what happened: status, show, verify and the run report."""
