"""The built-in metrics, models and datasets, registered through the hooks like any plugin."""
