"""Tests of the engine adapters (`workers.engines`)."""
