"""One device's names in a tower's call: absolute name scopes under the
tower's, scoped collection reads without the tower's name segment, and
shape functions that build Shape ops rather than fold a shard's size.

Patched while towers are built (`Patches` in `_towers.build`):
`Graph.name_scope`, `Graph.get_collection`, `Graph.get_collection_ref`,
and array_ops' `shape_internal` / `size_internal`.
"""

import contextlib
import re
import threading
from typing import Any, Callable, Iterator, List, Optional

import tensorflow as tf

# pylint: disable=protected-access,g-direct-tensorflow-import
from tensorflow.python.ops import array_ops as _array_ops

from replicate._tf import patches


def install_unfolded_shapes() -> List[Any]:
  """Makes `tf.shape` / `tf.size` of a static tensor build Shape / Size ops.

  TensorFlow folds them into constants (array_ops.shape_internal and
  size_internal with `optimize=True`), where a shard's size would pass
  for a number that is the same in every tower. Returns what to restore:
  (module, name, original) triples.
  """
  shape_internal = _array_ops.shape_internal
  size_internal = _array_ops.size_internal

  def shape(  # pylint: disable=redefined-builtin
      input: Any,
      name: Optional[str] = None,
      optimize: bool = True,
      out_type: Optional[tf.DType] = None) -> tf.Tensor:
    del optimize
    if out_type is None:
      return shape_internal(input, name, optimize=False)
    return shape_internal(input, name, optimize=False, out_type=out_type)

  def size(  # pylint: disable=redefined-builtin
      input: Any,
      name: Optional[str] = None,
      optimize: bool = True,
      out_type: tf.DType = tf.int32) -> tf.Tensor:
    del optimize
    return size_internal(input, name, optimize=False, out_type=out_type)

  _array_ops.shape_internal = shape
  _array_ops.size_internal = size
  return [(_array_ops, "shape_internal", shape_internal),
          (_array_ops, "size_internal", size_internal)]


class _TowerRoots(threading.local):
  """The name scope a tower built before tower 0 puts absolute scopes in,
  and the name segment (`tower_i`) its names carry that one device's
  names do not."""
  graph: Optional[tf.Graph] = None
  root: Optional[str] = None
  segment: Optional[str] = None
  # Called before the tower's call reads a collection.
  before_read: Optional[Callable[[Any], None]] = None
  bypass = 0


_roots = _TowerRoots()
_GRAPH_NAME_SCOPE = tf.Graph.name_scope


def _rooted_name_scope(self: tf.Graph, name: Optional[str]) -> Any:
  """Graph.name_scope, with the top level of the graph a tower's scope.

  The tower's own segment as a name re-enters the current scope: that is
  what entering the tower's variable scope object again opens (one
  device's top-level variable scope opens none).
  """
  root = _roots.root
  if self is _roots.graph and root and not _roots.bypass:
    if not name:
      name = root + "/"
    elif name == _roots.segment:
      current = tf.Graph.get_name_scope(self)
      name = current + "/" if current else None
    elif name.endswith("/") and not (name == root + "/" or
                                     name.startswith(root + "/")):
      name = root + "/" + name
  return _GRAPH_NAME_SCOPE(self, name)


def without_segment(name: str, segment: str) -> str:
  """`name` without its path components equal to `segment` (`tower_1`), nor
  empty ones (a variable scope '' inside a tower's adds one); a trailing
  '/' (an absolute name scope) is kept."""
  parts = [part for part in name.split("/") if part and part != segment]
  return "/".join(parts) + ("/" if parts and name.endswith("/") else "")


_GRAPH_GET_COLLECTION = tf.Graph.get_collection


def _towerless_get_collection(self: tf.Graph,
                              name: Any,
                              scope: Optional[str] = None) -> List[Any]:
  """Graph.get_collection, a scope matched as one device's names match it.

  In a tower built before tower 0, ops are named `tower_i/...` and the
  variables it shares are not; a scope is matched against names without
  the tower's segment, and the scope itself (from the tower's variable or
  name scope) is taken without it too, so that both match as on one device.
  """
  if self is not _roots.graph:
    return _GRAPH_GET_COLLECTION(self, name, scope)
  if _roots.before_read is not None:
    _roots.before_read(name)
  segment = _roots.segment
  if scope is None or not segment:
    return _GRAPH_GET_COLLECTION(self, name, scope)
  regex = re.compile(without_segment(scope, segment))
  found = []
  for item in _GRAPH_GET_COLLECTION(self, name):
    item_name = getattr(item, "name", None)
    if isinstance(item_name, str) and regex.match(
        without_segment(item_name, segment)):
      found.append(item)
  return found


def install_tower_roots() -> List[Any]:
  """Graph.name_scope sends absolute scopes of a tower into the tower's, and
  Graph.get_collection matches scopes without the tower's name segment.

  Model code resets the name scope (`tf.name_scope('')`, an absolute
  `'training/'`: the canned heads do, for Keras' names); in a tower built
  before tower 0 that would take the top-level names tower 0 (the unwrapped
  model's names) needs, so there they go under the tower's scope. Returns
  what to restore.
  """
  return [
      patches.patch(tf.Graph, "name_scope", _rooted_name_scope),
      patches.patch(tf.Graph, "get_collection", _towerless_get_collection),
      patches.patch(tf.Graph, "get_collection_ref", _read_collection_ref),
  ]


_GRAPH_GET_COLLECTION_REF = tf.Graph.get_collection_ref


def _read_collection_ref(self: tf.Graph, name: Any) -> List[Any]:
  """Graph.get_collection_ref, after the tower's `before_read`."""
  if self is _roots.graph and _roots.before_read is not None:
    _roots.before_read(name)
  return _GRAPH_GET_COLLECTION_REF(self, name)


@contextlib.contextmanager
def tower_root(graph: tf.Graph, root: Optional[str], segment: Optional[str],
               before_read: Callable[[Any], None]) -> Iterator[None]:
  """Inside, `graph`'s absolute name scopes go under `root`, scoped
  collection reads ignore the name segment `segment`, and
  `before_read(key)` runs before collection `key` is read (see above)."""
  before = (_roots.graph, _roots.root, _roots.segment, _roots.before_read)
  (_roots.graph, _roots.root, _roots.segment,
   _roots.before_read) = graph, root, segment, before_read
  try:
    yield
  finally:
    (_roots.graph, _roots.root, _roots.segment, _roots.before_read) = before


@contextlib.contextmanager
def top_level_name_scopes() -> Iterator[None]:
  """Inside, absolute name scopes are the graph's own again."""
  _roots.bypass += 1
  try:
    yield
  finally:
    _roots.bypass -= 1
