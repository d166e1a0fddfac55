"""One set of variables for all towers.

Towers after the first get tower 0's variables back from a variable creator
(Keras layers ignore variable-scope reuse) and find their layers under tower
0's names (name counters restored per tower).
"""

import collections
import copy
import re
from typing import Any, Dict, Optional

import tensorflow as tf
from absl import logging
# Variable-scope name counters have no public accessor.
from tensorflow.python.ops import variable_scope as variable_scope_lib  # pylint: disable=g-direct-tensorflow-import

from replicate import _devices
from replicate._context import Replication


class NameCounters:
  """Per-graph name counters, restored before every tower.

  Keras names layers `dense`, `dense_1`, ... and variable scopes opened
  with a default name are numbered the same way, by counters kept per
  graph. Restored before each tower, every tower names its layers as tower 0
  did, so tower i finds tower 0's variables and Keras layers line up.
  """

  def __init__(self):
    try:
      from keras.src import backend  # pylint: disable=g-import-not-at-top
    except ImportError:  # Keras moved or is absent: no counters to restore.
      backend = None
    self._keras = backend
    self.save()

  def save(self):
    """Takes the counters as they are now (on this thread)."""
    if self._keras is not None:
      self._uids = dict(self._keras.get_default_graph_uid_map())
      self._observed = set(self._keras.OBSERVED_NAMES)
    self._scope_counts = dict(_variable_scope_counts())

  def copy(self) -> "NameCounters":
    other = copy.copy(self)
    if self._keras is not None:
      other._uids = dict(self._uids)
      other._observed = set(self._observed)
    other._scope_counts = dict(self._scope_counts)
    return other

  def restore(self):
    """Puts the saved counters back (on this thread)."""
    if self._keras is not None:
      uids = self._keras.get_default_graph_uid_map()
      uids.clear()
      uids.update(self._uids)
      self._keras.OBSERVED_NAMES.clear()
      self._keras.OBSERVED_NAMES.update(self._observed)
    counts = _variable_scope_counts()
    counts.clear()
    counts.update(self._scope_counts)


def _variable_scope_counts() -> dict:
  """The graph's count of variable scopes opened under each name."""
  store = variable_scope_lib.get_variable_scope_store()
  return store.variable_scopes_count


def _is_model_state(kwargs) -> bool:
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
  `_devices.cache_device`).
  """
  if not replication.hub:
    return None
  device = _devices.cache_device(replication.graph,
                                 replication.split_op_names, replication.hub)
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
  graph = tf.compat.v1.get_default_graph()
  while graph is not None:
    # The active control dependencies have no public accessor.
    if graph._current_control_dependencies():  # pylint: disable=protected-access
      return True
    graph = getattr(graph, "outer_graph", None)
  return False


def _is_resource(variable) -> bool:
  """Whether `variable` is a resource variable (reference ones have no handle)."""
  handle = getattr(variable, "handle", None)
  return isinstance(handle, tf.Tensor) and handle.dtype == tf.resource


def read_once_per_step(variable, device: str, replication: Replication
                       ) -> None:
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
  variable (see `_lookups`): their gathers run where the variable is, and
  only rows cross. This is what `caching_device` does, but decided once the
  variable's device is known, and without the stale reads after writes.
  """
  if not (variable.trainable and
          _devices.other_task(variable.device, device)):
    return
  own = variable.value
  with tf.init_scope(), tf.compat.v1.device(None), tf.device(device):
    # Named after the variable, as its own reads are.
    with tf.name_scope(variable.op.name + "/"):
      cached = tf.identity(own(), name="read_once_per_step")

  def value():
    return own() if _after_writes_possible() else cached

  # Tensor conversion calls the variable's own `value`.
  variable.value = value
  replication.shared_copies[cached.ref()] = own
  if not _is_resource(variable):
    # A resource variable gathers on its own device; a reference one only
    # where the value it is given is.
    replication.shared_copies[variable.ref()] = own


def own_read(value, copies: Dict[Any, Any]) -> Optional[tf.Tensor]:
  """The variable's own read where the towers share a copy of it, else None.

  For the ops that must run where the variable is (see `_lookups`).
  `value`: a tensor or variable; `copies`: a `Replication.shared_copies`,
  which knows the shared copies and the reference variables they copy.
  """
  own = copies.get(value.ref())
  return None if own is None else own()


def variable_creator(replication: Replication, index: int, name_root: str):
  """Returns a creator giving towers after the first tower 0's variables.

  Variables are matched by the name they are asked for (relative to the
  tower's root scope) and how many times that name was asked for before,
  so TensorFlow's own uniquifying of names cannot pair the wrong ones.
  Local (metric) variables are shared too, like those `get_local_variable`
  gets back by variable-scope reuse, so that every tower's writes reach one
  variable and are combined by its aggregation (`_state`). A checkpointed
  variable tower 0 did not create is an error; a local one is the tower's.
  """
  counts = collections.Counter()
  created = replication.created[index]
  # Later towers get tower 0's variables and create no trained ones.
  cache = _cache_device(replication) if index == 0 else None

  def creator(next_creator, **kwargs):
    if replication.unshared:
      return next_creator(**kwargs)
    scope = tf.compat.v1.get_default_graph().get_name_scope()
    name = kwargs.get("name") or "Variable"
    full = f"{scope}/{name}" if scope else name
    relative = _without_root(full, name_root)
    counts[relative] += 1
    key = (relative, counts[relative])
    if index > 0:
      original = replication.created[0].get(key)
      if original is not None:
        return original
      if _is_model_state(kwargs):
        raise ValueError(
            f"Tower {index} creates variable {full!r} that tower 0 did not "
            f"create (tower 0 created {len(replication.created[0])} "
            "variables); every tower must build the same model, so make the "
            "model_fn create the same variables in every call.")
    variable = next_creator(**kwargs)
    if cache is not None:
      read_once_per_step(variable, cache, replication)
    created[key] = variable
    return variable

  return creator
