"""Batch normalization in training: the whole batch's statistics, or each
tower's own."""
