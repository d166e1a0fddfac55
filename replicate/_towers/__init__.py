"""Building the towers: one call of the model_fn per device, in turn, sharing
one set of variables."""
