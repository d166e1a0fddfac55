"""Walks over a graph's ops: every search of the library goes through `walk`;
`look_through` finds the value behind ops that pass it on.

The graphs walked are the towers' (tens of thousands of ops), so a walk is
iterative, visits each node once, and can stop early: it yields as it goes,
and `limit` bounds how many nodes it visits.
"""

from typing import (
    AbstractSet,
    Callable,
    Hashable,
    Iterable,
    Iterator,
    List,
    Optional,
    Set,
    TypeVar,
)

import tensorflow as tf

Node = TypeVar("Node", bound=Hashable)

# Ops that pass their first input on unchanged: `look_through`'s default.
IDENTITIES = frozenset(["Identity", "RefIdentity"])


def walk(start: Iterable[Node],
         neighbours: Callable[[Node], Iterable[Node]],
         limit: Optional[int] = None) -> Iterator[Node]:
  """Each node reachable from `start` through `neighbours`, once, depth first.

  Args:
    start: the nodes to begin with (yielded too).
    neighbours: a node's next nodes (its inputs' ops for ancestors, its
      outputs' consumers for descendants, or any other relation).
    limit: stop after this many nodes; None walks everything reachable.

  Yields:
    The nodes in the order they are reached.
  """
  seen: Set[Node] = set()
  pending = list(start)
  while pending and (limit is None or len(seen) < limit):
    node = pending.pop()
    if node in seen:
      continue
    seen.add(node)
    yield node
    pending.extend(neighbours(node))


def input_ops(op: tf.Operation) -> List[tf.Operation]:
  """The ops whose outputs `op` reads (data edges only)."""
  return [t.op for t in op.inputs]


def input_and_control_ops(op: tf.Operation) -> List[tf.Operation]:
  """The ops `op` reads or runs after."""
  return [t.op for t in op.inputs] + list(op.control_inputs)


def consumer_ops(op: tf.Operation) -> List[tf.Operation]:
  """The ops reading any output of `op`."""
  return [c for t in op.outputs for c in t.consumers()]


def ancestors(tensors: Iterable[tf.Tensor],
              limit: Optional[int] = None) -> Iterator[tf.Operation]:
  """The ops `tensors` are computed from (their own ops included)."""
  return walk([t.op for t in tensors], input_ops, limit)


def look_through(tensor: tf.Tensor,
                 types: AbstractSet[str] = IDENTITIES) -> tf.Tensor:
  """The tensor behind `tensor`'s chain of ops of `types`.

  Follows each op's first input while the op's type is in `types` (and it
  has inputs), so that a search sees the value behind ops that pass it on;
  each caller names the ops it counts as passing its value on (Identity and
  RefIdentity by default).
  """
  while tensor.op.type in types and tensor.op.inputs:
    tensor = tensor.op.inputs[0]
  return tensor
