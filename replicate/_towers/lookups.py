"""Embedding lookups of reference variables gather where the variable is.

On a parameter-server cluster the towers share one copy per step of each
trained variable of another task (`sharing.read_once_per_step`). A
reference variable (`use_resource=False`) has no gather of its own:
`tf.nn.embedding_lookup` converts it to its value and gathers colocated
with that value. Given the shared copy it would gather on the trainer, and
the whole table would cross the network each step where one device sends
the rows it looks up. So while towers are built, TensorFlow's
`embedding_lookup` (which its sparse and safe lookups and Keras'
`Embedding` call) is given such variables' own reads, as on one device.
So is a lookup given any variable's shared copy (its value converted: the
safe sparse lookup, which embedding columns use, converts its tables
first): on one device that read, too, is where the variable is.
"""

from typing import Any, Callable, ContextManager, Dict

import tensorflow as tf

from replicate import _context
from replicate import _tf
from replicate._towers import sharing


def _own_read(param: Any, copies: Dict[Any, Any]) -> Any:
  own = (
      sharing.own_read(param, copies) if isinstance(param,
                                                    (tf.Variable,
                                                     tf.Tensor)) else None)
  return param if own is None else own


def _own_reads(params: Any, copies: Dict[Any, Any]) -> Any:
  """`params` with each shared variable's own read for its shared copy.

  A reference variable may come as itself or as its copy (converted);
  `copies`: the replication's shared copies (`Replication.shared_copies`).
  As the lookup reads `params`: a list holds partitions, and so do a
  `PartitionedVariable`'s parts; anything else (a tensor, a tuple, an array)
  is one table, passed on as it is.
  """
  if isinstance(params, (list, _tf.PartitionedVariable)):
    return [_own_read(p, copies) for p in params]
  return _own_read(params, copies)


def _lookup(original: Callable[..., Any]) -> Callable[..., Any]:

  def embedding_lookup(params: Any, ids: Any, *args: Any, **kwargs: Any) -> Any:
    replication = _context.replication_on_thread()
    copies = {} if replication is None else replication.shared_copies
    return original(_own_reads(params, copies), ids, *args, **kwargs)

  return embedding_lookup


def _install() -> _tf.Patched:
  # tf.compat.v1.nn.embedding_lookup is the function the others call
  # (tf.nn.embedding_lookup, the sparse and safe lookups).
  original = tf.compat.v1.nn.embedding_lookup
  return _tf.rebind("embedding_lookup", original, _lookup(original))


_PATCHES = _tf.Patches("embedding lookups of reference variables", _install)


def routed(replication: _context.Replication) -> ContextManager[None]:
  """Lookups built inside read reference variables where they are."""
  return _PATCHES.applied(replication.num_towers > 1)
