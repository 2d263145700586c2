"""The audit file: its keys' specs, loading and validation, the JSON Schema, the starter file."""
