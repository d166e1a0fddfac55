"""Patches of public TensorFlow functions and methods while towers are built.

Public TensorFlow functions and methods (tf.gradients, GradientTape.gradient,
optimizer methods, embedding_lookup, tf.nn's moments, tf.shape, name_scope)
are routed while the towers are built. Several model_fns may build at once
(threads, nested graphs), so each set of patches is installed by the first
to enter and restored by the last to leave. `tf.gradients` adds the terms
of an op's output gradient in gradients_util's `_AggregatedGrads`, which
is routed here.
"""

import contextlib
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from absl import logging
import tensorflow as tf

# pylint: disable=protected-access,g-direct-tensorflow-import
from tensorflow.python.ops import gradients_util as _gradients_util

# (owner, attribute name, original value), as an install function sets them.
Patched = List[Tuple[Any, str, Any]]

# Per thread: the function summing a variable's gradient terms, or None.
_gradient_sums = threading.local()


@contextlib.contextmanager
def gradient_terms_summed_by(
    sum_terms: Callable[[tf.Operation, List[Any]], Optional[Any]]
) -> Iterator[None]:
  """Inside, `tf.gradients` asks `sum_terms(op, terms)` for the gradient of
  an op's only output with several terms, before adding them itself; a
  None answer leaves the terms to TensorFlow. Needs `GRADIENT_TERMS`
  applied."""
  before = getattr(_gradient_sums, "current", None)
  _gradient_sums.current = sum_terms
  try:
    yield
  finally:
    _gradient_sums.current = before


def install_gradient_terms() -> Patched:
  """Routes gradients_util._AggregatedGrads, where `tf.gradients` adds the
  terms of each op's output gradient (an AddN colocated with the op)."""
  original = _gradients_util._AggregatedGrads

  def aggregated(grads: Dict[Any, Any], op: tf.Operation, *args: Any,
                 **kwargs: Any) -> Any:
    sum_terms = getattr(_gradient_sums, "current", None)
    loop_state = args[1] if len(args) > 1 else kwargs.get("loop_state")
    terms = grads.get(op)
    if (sum_terms is not None and not loop_state and terms is not None and
        len(terms) == 1 and isinstance(terms[0], list) and terms[0]):
      summed = sum_terms(op, list(terms[0]))
      if summed is not None:
        terms[0] = summed
        return terms
    return original(grads, op, *args, **kwargs)

  return [patch(_gradients_util, "_AggregatedGrads", aggregated)]


def patch(owner: Any, name: str, value: Any) -> Tuple[Any, str, Any]:
  """Sets `owner.name` to `value`; returns what `Patches` restores."""
  original = owner.__dict__.get(name)
  setattr(owner, name, value)
  return (owner, name, original)


def rebind(name: str, original: Any, routed: Any) -> Patched:
  """Binds `routed` wherever a TensorFlow module binds `original` as `name`.

  TensorFlow exports one function under several modules (e.g. `tf.nn.relu`,
  `tf.compat.v1.nn.relu`, `gen_nn_ops.relu`); model code may call any of
  them. Returns what `Patches` restores.
  """
  patched = []
  for module_name, module in list(sys.modules.items()):
    if (module is not None and module_name.startswith("tensorflow") and
        getattr(module, "__dict__", {}).get(name) is original):
      patched.append((module, name, original))
      setattr(module, name, routed)
  return patched


class Patches:
  """One set of patches, installed while any builder is inside `applied()`.

  Args:
    what: what the patches route, for the log line.
    install: sets the patched attributes and returns what they were.
  """

  _every: List["Patches"] = []

  def __init__(self, what: str, install: Callable[[], Patched]):
    self._what = what
    self._install = install
    self._lock = threading.Lock()
    self._count = 0
    self._originals: Patched = []
    Patches._every.append(self)

  @classmethod
  def every(cls) -> List["Patches"]:
    """Every set of patches made so far (the modules make theirs on
    import)."""
    return list(cls._every)

  @property
  def installed(self) -> bool:
    """Whether a builder is inside `applied()` now."""
    return self._count > 0

  @property
  def what(self) -> str:
    return self._what

  @contextlib.contextmanager
  def applied(self, needed: bool = True) -> Iterator[None]:
    """Installed inside (by the first builder to enter), unless not needed."""
    if not needed:
      yield
      return
    with self._lock:
      if not self._count:
        self._originals = self._install()
        logging.info("replicate: %s routed (%d attributes)", self._what,
                     len(self._originals))
      self._count += 1
    try:
      yield
    finally:
      with self._lock:
        self._count -= 1
        if not self._count:
          for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
          self._originals = []
