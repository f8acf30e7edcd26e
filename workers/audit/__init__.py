"""Teacher-forced recomputation behind `pipeline verify`."""
