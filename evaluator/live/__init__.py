"""Auditing live training: the programmatic API, the monitor, and its Lightning and Flower glue."""
