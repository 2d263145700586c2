"""The audit engine: audit files, scenarios, the runner, metrics, utility, reports and the CLI."""
