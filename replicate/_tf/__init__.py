"""Every private TensorFlow and Keras access of the library, named.

TensorFlow has no public API to rewire an op's input after it is built,
to read a function call's body, to see a graph's control-flow context or
its per-thread scope stacks, to reach Keras' name counters, a Keras
optimizer's own name, step counter and gradient computation, an
Estimator's warm-start settings, or the checkpoint dependencies of an
object wrapping an optimizer. Public TensorFlow functions the towers route
(`tf.gradients`, `GradientTape.gradient`, optimizer methods,
`embedding_lookup`, tf.nn's moments, `tf.shape`, `Graph.name_scope`) are
patched only here, through `Patches`, while towers are built. Each access
below says what it reads or changes and was checked on TensorFlow 2.13
to 2.21 (with Keras 2 and tensorflow_estimator of the same line, 2.15's
from 2.16 on);
nothing else in the library touches a private name or patches an
attribute (tests/test_layout.py checks).

One module per concept: `graph_edits` (an op's inputs, control inputs,
device, colocation), `graph_state` (what a graph holds that a call reads),
`functions` (function bodies, copies on a device), `tower_scopes` (one
device's names in a tower's call), `library_internals` (Keras optimizers',
Estimators' and tensorflow_estimator's unexported attributes), `patches`
(installing and restoring routes; the gradient terms' route),
`checkpoints` (an optimizer wrapper's dependencies), `estimator_compat`
(tf.estimator on TensorFlow 2.16+, applied first by `replicate/__init__`).
This package exports their names for the library's modules.
"""

from replicate._tf.checkpoints import TracksWrapped
from replicate._tf.functions import TracedGradient
from replicate._tf.functions import called_functions
from replicate._tf.functions import custom_gradient_type
from replicate._tf.functions import function_bodies
from replicate._tf.functions import function_on_device
from replicate._tf.functions import trace_custom_gradient
from replicate._tf.graph_edits import add_control_input
from replicate._tf.graph_edits import control_outputs
from replicate._tf.graph_edits import copy_gradient_function
from replicate._tf.graph_edits import op_id
from replicate._tf.graph_edits import remove_control_inputs
from replicate._tf.graph_edits import replace_colocation
from replicate._tf.graph_edits import rewire
from replicate._tf.graph_edits import set_device
from replicate._tf.graph_edits import unknown_shapes_attr
from replicate._tf.graph_edits import update_input
from replicate._tf.graph_state import NameCounters
from replicate._tf.graph_state import active_control_inputs
from replicate._tf.graph_state import collections
from replicate._tf.graph_state import graph_store
from replicate._tf.graph_state import in_v1_control_flow
from replicate._tf.graph_state import names_in_use
from replicate._tf.graph_state import op_in_v1_control_flow
from replicate._tf.graph_state import set_collections
from replicate._tf.graph_state import set_store_contents
from replicate._tf.graph_state import share_variable
from replicate._tf.graph_state import store_contents
from replicate._tf.graph_state import variable_store
from replicate._tf.library_internals import NN_IMPL
from replicate._tf.library_internals import PartitionedVariable
from replicate._tf.library_internals import canned_optimizer
from replicate._tf.library_internals import canned_optimizer_v2
from replicate._tf.library_internals import keras_compute_gradients
from replicate._tf.library_internals import keras_iterations
from replicate._tf.library_internals import optimizer_name
from replicate._tf.library_internals import warm_start_settings
from replicate._tf.patches import Patched
from replicate._tf.patches import Patches
from replicate._tf.patches import gradient_terms_summed_by
from replicate._tf.patches import install_gradient_terms
from replicate._tf.patches import patch
from replicate._tf.patches import rebind
from replicate._tf.servers import end_on_unavailable
from replicate._tf.servers import lead_collectives_from_chief
from replicate._tf.tower_scopes import install_tower_roots
from replicate._tf.tower_scopes import install_unfolded_shapes
from replicate._tf.tower_scopes import top_level_name_scopes
from replicate._tf.tower_scopes import tower_root
from replicate._tf.tower_scopes import without_segment

__all__ = [
    "end_on_unavailable", "lead_collectives_from_chief", "NN_IMPL",
    "NameCounters", "PartitionedVariable", "Patched", "Patches",
    "TracedGradient", "TracksWrapped", "active_control_inputs",
    "add_control_input", "called_functions", "canned_optimizer",
    "canned_optimizer_v2", "collections", "control_outputs",
    "custom_gradient_type", "copy_gradient_function", "function_bodies",
    "function_on_device", "gradient_terms_summed_by", "graph_store",
    "in_v1_control_flow", "install_gradient_terms", "install_tower_roots",
    "install_unfolded_shapes", "keras_compute_gradients", "keras_iterations",
    "names_in_use", "op_id", "op_in_v1_control_flow", "optimizer_name", "patch",
    "rebind", "remove_control_inputs", "replace_colocation", "rewire",
    "set_collections", "set_device", "set_store_contents", "share_variable",
    "store_contents", "top_level_name_scopes", "trace_custom_gradient",
    "tower_root", "unknown_shapes_attr", "update_input", "variable_store",
    "warm_start_settings", "without_segment"
]
