"""Attributes patched while towers are built, and put back after.

Optimizer methods, `tf.gradients` and Keras batch norm's moments are
routed through the towers' meeting points only while a replicated model_fn
builds its towers. Several model_fns may build at once (threads, nested
graphs), so each set of patches is installed by the first to enter and
restored by the last to leave.
"""

import contextlib
import sys
import threading
from typing import Any, Callable, List, Tuple

from absl import logging

# (owner, attribute name, original value), as an install function sets them.
Patched = List[Tuple[Any, str, Any]]


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

  def __init__(self, what: str, install: Callable[[], Patched]):
    self._what = what
    self._install = install
    self._lock = threading.Lock()
    self._count = 0
    self._originals: Patched = []

  @property
  def installed(self) -> bool:
    """Whether some builder is inside `applied()` now."""
    return self._count > 0

  @contextlib.contextmanager
  def applied(self, needed: bool = True):
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
