"""Embedding lookups of reference variables gather where the variable is.

On a parameter-server cluster the towers share one copy per step of each
trained variable of another task (`_sharing.read_once_per_step`). A
reference variable (`use_resource=False`) has no gather of its own:
`tf.nn.embedding_lookup` converts it to its value and gathers colocated
with that value. Given the shared copy it would gather on the trainer, and
the whole table would cross the network each step where one device sends
the rows it looks up. So while towers are built, TensorFlow's
`embedding_lookup` (which its sparse and safe lookups and Keras'
`Embedding` call) is given such variables' own reads, as on one device.
"""

import collections.abc
from typing import Any, Callable

import tensorflow as tf

from replicate import _context
from replicate import _patches
from replicate import _sharing


def _own_reads(params: Any) -> Any:
  """`params` with each shared reference variable replaced by its own read."""
  if isinstance(params, tf.Variable):
    own = _sharing.own_read(params)
    return params if own is None else own
  if not isinstance(params, collections.abc.Iterable):
    return params
  # A list, or a PartitionedVariable's parts.
  return [_own_reads(p) if isinstance(p, tf.Variable) else p for p in params]


def _lookup(original: Callable[..., Any]) -> Callable[..., Any]:
  def embedding_lookup(params, ids, *args, **kwargs):
    return original(_own_reads(params), ids, *args, **kwargs)
  return embedding_lookup


def _install() -> _patches.Patched:
  # tf.compat.v1.nn.embedding_lookup is the function the others call
  # (tf.nn.embedding_lookup, the sparse and safe lookups).
  original = tf.compat.v1.nn.embedding_lookup
  return _patches.rebind("embedding_lookup", original, _lookup(original))


_PATCHES = _patches.Patches("embedding lookups of reference variables",
                            _install)


def routed(replication: _context.Replication):
  """Lookups built inside read reference variables where they are."""
  return _PATCHES.applied(replication.num_towers > 1)
