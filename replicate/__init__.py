"""replicate: run a TensorFlow Estimator model_fn on every local device.

Wrap a model_fn once with `replicate_model_fn` (its optimizers are routed
as they are; `TowerOptimizer` adds gradient transforms); each batch is
split across the devices and the result equals one device's. `replicate.testing` checks that your own model_fn
does, on virtual CPU devices.
"""

from replicate._collectives import batch_concat
from replicate._collectives import batch_sum
from replicate._core import replicate_model_fn
from replicate._devices import VariablePlacement
from replicate._optimizer import TowerOptimizer
from replicate._context import current_tower
from replicate import testing

__version__ = "0.1.0"

__all__ = (
    "TowerOptimizer",
    "VariablePlacement",
    "batch_concat",
    "batch_sum",
    "current_tower",
    "replicate_model_fn",
    "testing",
)
