"""Testing a replicated model_fn on any machine, GPUs or not.

`assert_replicates` checks the property `replicate` promises, on your own
model_fn: trained, evaluated and predicting on N towers, it gives one
device's results. The towers are virtual CPU devices of one session, so the
check runs on a laptop or a CPU-only CI machine.

    import replicate.testing

    def test_model_fn_replicates():
      replicate.testing.assert_replicates(model_fn, input_fn, params={...})

`virtual_cpus` splits the host CPU into N devices (for eager code and
`tf.distribute`); `run_config` and `session_config` give an Estimator a
session with N CPU devices, which is all a graph-mode Estimator needs.
`replicated` turns a canned estimator's constructor into one that builds the
same estimator replicated on N virtual CPUs, for canned-model integration
tests.
"""

from replicate.testing._configs import run_config
from replicate.testing._configs import session_config
from replicate.testing._configs import virtual_cpus
from replicate.testing._equivalence import ReplicationMismatch
from replicate.testing._equivalence import Summary
from replicate.testing._equivalence import assert_replicates
from replicate.testing._estimators import replicated

__all__ = (
    "ReplicationMismatch",
    "Summary",
    "assert_replicates",
    "replicated",
    "run_config",
    "session_config",
    "virtual_cpus",
)
