"""Run a TensorFlow Estimator model_fn on every local device, as one device.

Wrap a model_fn once; each batch the input_fn gives is split across the
devices (towers), every tower shares one set of variables, and the losses,
gradients, updates, metrics, predictions, summaries and exports equal one
device's on the whole batch:

    import replicate

    estimator = tf.estimator.Estimator(
        model_fn=replicate.replicate_model_fn(model_fn), ...)

Optimizers are used as they are; `TowerOptimizer` adds gradient transforms
that need one device's gradients. Inside the model_fn, `current_tower`
says which tower is being built, and `batch_sum` / `batch_concat` give the
whole batch's value of a per-row tensor. `replicate.testing` checks your own
model_fn against one device on virtual CPU devices.
"""

# First of all: on TensorFlow 2.16+ tf.estimator is made to work (Keras 2
# behind tf.keras) before anything touches tf.keras; nothing on <= 2.15.
from replicate._tf import estimator_compat as _estimator_compat

_estimator_compat.ensure_estimator()

from replicate import testing
from replicate._context import Tower
from replicate._context import current_tower
from replicate._core import replicate_model_fn
from replicate._meet.collectives import batch_concat
from replicate._meet.collectives import batch_sum
from replicate._meet.tower_optimizer import TowerOptimizer
from replicate._prepare.devices import VariablePlacement

__version__ = "0.1.0"

__all__ = (
    "Tower",
    "TowerOptimizer",
    "VariablePlacement",
    "batch_concat",
    "batch_sum",
    "current_tower",
    "replicate_model_fn",
    "testing",
)
