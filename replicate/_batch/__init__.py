"""What a tower's tensors hold (its rows or whole values), sums over towers, and
the ops a step runs."""
