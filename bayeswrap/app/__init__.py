"""The application layer: the only code that knows a run config (config, CLI, one run, comparison, reports)."""
