"""Pipelines: the stages chained into one answer (``prism run``), above the stages, below the CLI."""
