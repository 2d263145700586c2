"""Running an audit: the scenario, the runner and its executors, the run folder, tuning, utility."""
