"""One set of variables for all towers.

Towers after the first get tower 0's variables back from a variable creator
(Keras layers ignore variable-scope reuse) and find their layers under tower
0's names (name counters restored per tower).
"""

import collections
import copy
import re

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


def _is_trainable(kwargs) -> bool:
  """Whether a variable being created is trained (read by the forward pass)."""
  trainable = kwargs.get("trainable")
  if trainable is None:
    return kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ
  return bool(trainable)


def _is_resource(kwargs) -> bool:
  """Whether a variable being created is a resource variable.

  A reference variable's cached copy is what its gathers read too
  (`tf.gather` converts it to a tensor), so caching it would send a whole
  embedding table each step instead of the rows: those are left alone.
  """
  use_resource = kwargs.get("use_resource")
  if use_resource is None:
    return tf.compat.v1.resource_variables_enabled()
  return bool(use_resource)


def _cache_device(replication: Replication):
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
        "replicate: towers on a cluster task; trained variables of other "
        "tasks are read once per step onto %s (caching_device)", device)
  return device


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
    if (cache is not None and _is_trainable(kwargs) and
        _is_resource(kwargs) and kwargs.get("caching_device") is None):
      kwargs["caching_device"] = _devices.caching_device_function(cache)
    variable = next_creator(**kwargs)
    created[key] = variable
    return variable

  return creator
