"""One set of variables for all towers.

The first tower built creates the model's variables, under the names the
unwrapped model_fn gives them (its `tower_i/` name scope left out); every
later tower gets them back from a variable creator (Keras layers ignore
variable-scope reuse), matched by the name asked for and how often.
"""

import collections
from typing import Any, Callable, Counter, Dict, Optional, Tuple, Union

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate import _tf
from replicate._context import Replication
from replicate._prepare import devices


def _is_model_state(kwargs: Dict[str, Any]) -> bool:
  """Whether a variable being created would be saved in checkpoints."""
  collections_ = kwargs.get("collections")
  if collections_ is None:
    return True
  return tf.compat.v1.GraphKeys.GLOBAL_VARIABLES in collections_


def _cache_device(replication: Replication) -> Optional[str]:
  """Where trained variables on another task are read once per step, or None.

  Worked out from where the input split was placed (see
  `devices.cache_device`).
  """
  if not replication.consolidation_device:
    return None
  device = devices.cache_device(replication.graph, replication.split_op_names,
                                replication.consolidation_device)
  if device is not None:
    logging.info(
        "replicate: towers on cluster task %s; trained variables of other "
        "tasks are read once per step there", device)
  return device


def _after_writes_possible() -> bool:
  """Whether a read made now may be ordered after a write of the step.

  That is a read under control dependencies (an EMA of the weights after
  the train_op), in this graph or one a function body is built in.
  """
  return _tf.active_control_inputs(tf.compat.v1.get_default_graph())


def _is_resource(variable: tf.Variable) -> bool:
  """Whether `variable` is a resource variable (a reference one has no
  handle)."""
  handle = getattr(variable, "handle", None)
  return isinstance(handle, tf.Tensor) and handle.dtype == tf.resource


def read_once_per_step(variable: tf.Variable, device: str,
                       replication: Replication) -> None:
  """Makes the towers share one read of `variable` per step, on `device`.

  For a trained variable on another task than the towers (a parameter
  server): its value (what `tf.convert_to_tensor` and every op taking the
  variable read) becomes one copy on the towers' task, made at the start of
  the step, instead of one read over the network per tower. TensorFlow adds
  the towers' gradient contributions where that copy is (gradients are
  colocated with their ops), so one summed gradient crosses the network
  too. A read that may come after a write of the same step (under control
  dependencies) reads as on one device: a resource variable afresh, a
  reference variable its own snapshot (stale there on one device too). So
  do a resource variable's `read_value()` and gathers (`sparse_read`: an
  embedding's rows), and TensorFlow's embedding lookups of a reference
  variable (see `_towers.lookups`): their gathers run where the variable is, and
  only rows cross. This is what `caching_device` does, but decided once the
  variable's device is known, and without the stale reads after writes.
  """
  if not (variable.trainable and devices.other_task(variable.device, device)):
    return
  own = variable.value
  with tf.init_scope(), tf.compat.v1.device(None), tf.device(device):
    # Named after the variable, as its own reads are.
    with tf.name_scope(variable.op.name + "/"):
      cached = tf.identity(own(), name="read_once_per_step")

  def value() -> tf.Tensor:
    return own() if _after_writes_possible() else cached

  # Tensor conversion calls the variable's own `value`.
  variable.value = value
  replication.shared_copies[cached.ref()] = own
  if not _is_resource(variable):
    # A resource variable gathers on its own device; a reference one only
    # where the value it is given is.
    replication.shared_copies[variable.ref()] = own


def own_read(value: Union[tf.Tensor, tf.Variable],
             copies: Dict[Any, Any]) -> Optional[tf.Tensor]:
  """The variable's own read where the towers share a copy of it, else None.

  For the ops that must run where the variable is (see `_towers.lookups`).
  `value`: a tensor or variable; `copies`: a `Replication.shared_copies`,
  which knows the shared copies and the reference variables they copy.
  """
  own = copies.get(value.ref())
  return None if own is None else own()


def _shape_of(kwargs: Dict[str, Any]) -> Optional[tf.TensorShape]:
  shape = kwargs.get("shape")
  if shape is None:
    initial = kwargs.get("initial_value")
    shape = getattr(initial, "shape", None)
  try:
    return None if shape is None else tf.TensorShape(shape)
  except (TypeError, ValueError):
    return None


def _name_parts(graph: tf.Graph, name: str,
                segment: Optional[str]) -> Tuple[str, str]:
  """The name one device gives a variable asked for as `name` now, and the
  name it was asked for, both without the tower's name segment.

  The first is made unique as TensorFlow makes it (`unique_name`, among the
  tower's names, which are one device's with the segment added: see
  `_towers.views`); a name ending in '/' is absolute, taken as it is.
  """
  if name.endswith("/"):
    # Named by a name scope the tower opened (v1 metrics' `name=scope`).
    towerless = _tf.without_segment(name, segment) if segment else name
    return towerless, towerless
  scope = graph.get_name_scope()
  asked = f"{scope}/{name}" if scope else name
  unique = graph.unique_name(name)
  if not segment:
    return unique, asked
  return (_tf.without_segment(unique,
                              segment), _tf.without_segment(asked, segment))


def variable_creator(replication: Replication,
                     index: int) -> Callable[..., tf.Variable]:
  """Returns a creator sharing the first built tower's variables.

  The first tower built (`replication.creator`) creates each variable under
  the name the unwrapped model_fn gives it: its own `tower_i` name segment
  is left out. Every other tower gets those variables back, matched by the
  name asked for (relative to the tower's scope) and how many times that
  name was asked for before, so TensorFlow's own uniquifying of names
  cannot pair the wrong ones; it sees them join its collections and take
  their names as its own creation would (`_towers.views`). Local (metric)
  variables are shared too, like those `get_local_variable` gets back by
  variable-scope reuse, so that the towers' writes reach one variable
  (`_merge.state`). A checkpointed variable the first tower did not create,
  or asked for with another shape, is an error; a local one is the tower's.
  """
  counts: Counter[str] = collections.Counter()
  created = replication.created[index]
  creating = index == replication.creator
  segment = f"tower_{index}" if index else None
  views = replication.views
  # Trained variables of a parameter server are read once per step.
  cache = _cache_device(replication) if creating else None

  def creator(next_creator: Callable[..., tf.Variable],
              **kwargs: Any) -> tf.Variable:
    if replication.unshared:
      return next_creator(**kwargs)
    graph = tf.compat.v1.get_default_graph()
    name = kwargs.get("name") or "Variable"
    if not creating:
      relative = _asked(graph, name)
      if segment:
        relative = _tf.without_segment(relative, segment)
      counts[relative] += 1
      original = replication.created[replication.creator].get(
          (relative, counts[relative]))
      if original is not None:
        _check_shape(replication, index, relative, original, kwargs)
        if index and not name.endswith("/"):
          graph.unique_name(name)  # taken in this tower as on one device
        views.obtained(original)
        return original
      if _is_model_state(kwargs):
        raise ValueError(
            f"Tower {index} creates variable {relative!r} that tower "
            f"{replication.creator}, the first built, did not create (it "
            f"created {len(replication.created[replication.creator])} "
            "variables); every tower must build the same model, so make the "
            "model_fn create the same variables in every call.")
      return next_creator(**kwargs)
    unique, relative = _name_parts(graph, name, segment)
    counts[relative] += 1
    # An absolute name ('a/b/') is taken as it is, at the top level.
    scope, _, kwargs["name"] = ("", "", unique) if unique.endswith("/") else (
        unique.rpartition("/"))
    lengths = views.lengths()
    with replication.library(), _tf.top_level_name_scopes():
      with _context.absolute_name_scope(graph, scope):
        variable = next_creator(**kwargs)
      if cache is not None:
        read_once_per_step(variable, cache, replication)
    views.record_created(variable, lengths)
    if variable.op.name != unique.rstrip("/"):
      logging.warning(
          "replicate: variable %r is named %r, not %r as on one device (the "
          "name was taken)", relative, variable.op.name, unique.rstrip("/"))
    created[(relative, counts[relative])] = variable
    return variable

  return creator


def _asked(graph: tf.Graph, name: str) -> str:
  """The name a variable is asked for in tower 0 (whose names are one
  device's)."""
  if name.endswith("/"):
    return name
  scope = graph.get_name_scope()
  return f"{scope}/{name}" if scope else name


def _check_shape(replication: Replication, index: int, relative: str,
                 original: tf.Variable, kwargs: Dict[str, Any]) -> None:
  shape = _shape_of(kwargs)
  if shape is not None and not shape.is_compatible_with(original.shape):
    raise ValueError(
        f"Tower {index} asks for variable {relative!r} with shape {shape}, "
        f"but tower {replication.creator}, the first built, created it with "
        f"shape {original.shape}; every tower must build the same model "
        "(e.g. not draw a layer's width in each model_fn call).")


def towerless_getter(segment: str) -> Callable[..., Any]:
  """A custom getter giving `get_variable` names without `segment`.

  A tower's variable scope carries its name segment (`tower_1/dense`), as
  its name scope does; the variable store is keyed by one device's names
  (what `tf.compat.v1.train.init_from_checkpoint` and reuse look up), so
  the segment is left out of the name the store sees, wherever it occurs
  (a slot or moving average named after a tower's op carries it inside).
  """

  def getter(  # pylint: disable=redefined-outer-name
      getter: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    return getter(_tf.without_segment(name, segment), *args, **kwargs)

  return getter
