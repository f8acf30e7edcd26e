"""The `pipeline` command line: one subcommand protocol, commands loaded from entry points."""
