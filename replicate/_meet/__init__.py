"""Meetings: the calls that need every tower (optimizer calls, gradients,
collectives, batch reductions), built once after the last tower."""
