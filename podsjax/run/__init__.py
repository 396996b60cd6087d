"""A run's records: checkpoints, host state, the best model, run files, metrics and log backends."""
