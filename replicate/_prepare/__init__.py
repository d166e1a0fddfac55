"""Before the towers: devices, the cluster, the batch's leaves and their
split."""
