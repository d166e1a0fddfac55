"""One set of variables for all towers.

The first tower built creates the model's variables, under the names the
unwrapped model_fn gives them (its `tower_i/` name scope left out); every
later tower gets them back from a variable creator (Keras layers ignore
variable-scope reuse), matched by the name asked for and how often.
"""

import collections
import re
from typing import Any, Callable, Counter, Dict, Optional, Set, Union

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


def _without_root(name: str, root: str) -> str:
  """`name` with the tower's root scope removed wherever it occurs.

  Keras layers built inside a Keras model also carry the scope they were
  declared in (`tower_1/dnn/tower_1/hiddenlayer_0/kernel`), not only the
  one they are called in.
  """
  if not root:
    return name
  return re.sub(r"(^|/)" + re.escape(root), r"\1", name)


def _cache_device(replication: Replication) -> Optional[str]:
  """Where trained variables on another task are read once per step, or None.

  Worked out from where the input split was placed (see
  `devices.cache_device`).
  """
  if not replication.hub:
    return None
  device = devices.cache_device(replication.graph, replication.split_op_names,
                                replication.hub)
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


def variable_creator(replication: Replication, index: int,
                     name_root: str) -> Callable[..., tf.Variable]:
  """Returns a creator sharing the first built tower's variables.

  The first tower built (`replication.creator`) creates each variable under
  the name the unwrapped model_fn gives it: its own `tower_i/` name scope
  is left out. Every other tower gets those variables back, matched by the
  name asked for (relative to the tower's scope) and how many times that
  name was asked for before, so TensorFlow's own uniquifying of names
  cannot pair the wrong ones. Local (metric) variables are shared too, like
  those `get_local_variable` gets back by variable-scope reuse, so that the
  towers' writes reach one variable (`_merge.state`). A checkpointed variable
  the first tower did not create, or asked for with another shape, is an error;
  a local one is the tower's.
  """
  counts: Counter[str] = collections.Counter()
  created = replication.created[index]
  creating = index == replication.creator
  # Trained variables of a parameter server are read once per step.
  cache = _cache_device(replication) if creating else None
  root = replication.root_name_scope

  def creator(next_creator: Callable[..., tf.Variable],
              **kwargs: Any) -> tf.Variable:
    if replication.unshared:
      return next_creator(**kwargs)
    graph = tf.compat.v1.get_default_graph()
    scope = graph.get_name_scope()
    name = kwargs.get("name") or "Variable"
    full = f"{scope}/{name}" if scope else name
    relative = _without_root(full, name_root)
    counts[relative] += 1
    key = (relative, counts[relative])
    if not creating:
      original = replication.created[replication.creator].get(key)
      if original is not None:
        _check_shape(replication, index, relative, original, kwargs)
        _obtained(replication, index).add(id(original))
        return original
      if _is_model_state(kwargs):
        raise ValueError(
            f"Tower {index} creates variable {relative!r} that tower "
            f"{replication.creator}, the first built, did not create (it "
            f"created {len(replication.created[replication.creator])} "
            "variables); every tower must build the same model, so make the "
            "model_fn create the same variables in every call.")
    unwrapped = _without_root(scope +
                              "/", name_root).rstrip("/") if (scope) else ""
    unwrapped = "/".join(part for part in (root, unwrapped) if part)
    with replication.library(), _tf.top_level_name_scopes():
      with _context.absolute_name_scope(graph, unwrapped):
        variable = next_creator(**kwargs)
      if cache is not None:
        read_once_per_step(variable, cache, replication)
    created[key] = variable
    _obtained(replication, index).add(id(variable))
    return variable

  return creator


def _obtained(replication: Replication, index: int) -> Set[int]:
  """Ids of the variables tower `index` created or was given."""
  store = _context.graph_store(replication.graph, "variables per tower")
  return store.setdefault((id(replication), index), set())


def _check_shape(replication: Replication, index: int, relative: str,
                 original: tf.Variable, kwargs: Dict[str, Any]) -> None:
  shape = _shape_of(kwargs)
  if shape is not None and not shape.is_compatible_with(original.shape):
    raise ValueError(
        f"Tower {index} asks for variable {relative!r} with shape {shape}, "
        f"but tower {replication.creator}, the first built, created it with "
        f"shape {original.shape}; every tower must build the same model "
        "(e.g. not draw a layer's width in each model_fn call).")


def sharing_getter(replication: Replication, index: int) -> Callable[..., Any]:
  """A custom getter for `tf.compat.v1.get_variable` in a later tower.

  It gets the first tower's variables back (variable-scope reuse, for the
  tower's own calls only: a meeting's optimizer creates its slots). The
  variable store checks a variable it reuses itself, before any creator:
  its errors are given the towers' terms here.
  """

  def getter(  # pylint: disable=redefined-outer-name
      getter: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if replication.unshared:
      return getter(*args, **kwargs)
    name = kwargs.get("name", args[0] if args else None)
    if kwargs.get("reuse") is not tf.compat.v1.AUTO_REUSE:
      kwargs["reuse"] = True
    try:
      variable = getter(*args, **kwargs)
      for part in (list(variable) if isinstance(
          variable, _tf.PartitionedVariable) else [variable]):
        _obtained(replication, index).add(id(part))
      return variable
    except ValueError as error:
      if "does not exist" in str(error):
        raise ValueError(
            f"Tower {index} creates variable {name!r} that tower "
            f"{replication.creator}, the first built, did not create; every "
            "tower must build the same model, so make the model_fn create "
            "the same variables in every call.") from None
      if "share variable" not in str(error):
        raise
      raise ValueError(
          f"Tower {index}'s model_fn call asks for variable {name!r} "
          f"differently from tower {replication.creator}, the first built "
          f"({error}); every tower must build the same model: the same "
          "variables with the same shapes in every model_fn call.") from None

  return getter
