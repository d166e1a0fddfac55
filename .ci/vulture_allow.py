"""Names vulture reports in `replicate/` that are used where it cannot see.

Run as `vulture replicate .ci/vulture_allow.py` (`.ci/run` does). Each
entry says who uses the name; a new report is dead code to remove, or a
use to add here with its reason.
"""
# pylint: skip-file
# ruff: noqa
TypeGuard  # row_kinds: in string annotations ("TypeGuard[Rows]")
a_indices  # value_rules: unpacked beside the kinds the rule reads
_kernel_moments_gradient  # moments: registered with tf.RegisterGradient
_written_out_gradient  # moments: registered with tf.RegisterGradient
unused_dy  # moments: a gradient function's argument TensorFlow passes
_.watch  # routing.GraphTape: GradientTape's API, called by user code
unused_tensor  # routing.GraphTape.watch's argument
unused_replicated  # routing: an argument every route takes
ROUND_ROBIN  # devices.VariablePlacement: public, chosen by users
_.every  # _tf.Patches: tests/test_long_run.py checks every set is undone
_.installed  # _tf.Patches: the same
pytest_addoption  # pytest_plugin: a pytest hook
pytest_configure  # pytest_plugin: a pytest hook
metrics  # testing.Replicated: a field of the report users read
_.disable_meta_optimizer  # testing: a RewriterConfig field set on a proto
Meets  # _context: a Protocol named in string annotations ("Meets")
Rewires  # _context: the same
Views  # _context: the same
_.create_module  # estimator_compat: importlib's Loader API, called by imports
_.exec_module  # estimator_compat: the same
_.collective_group_leader  # _tf.servers: a ConfigProto field set on a proto
