"""One EstimatorSpec from the towers: state writes, metrics, summaries, hooks,
predictions, exports."""
