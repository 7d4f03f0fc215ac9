"""Subcommands of the `structgen` CLI, one module each."""
