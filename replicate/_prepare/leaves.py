"""What a batch's leaves are.

An input_fn may return Python lists (`{'age': [[10.], [20.]]}`, labels
`[[1], [0]]`): feature columns and heads convert them to tensors, so on one
device such a list is one value, not a structure of scalars. `as_tensors`
makes the same conversion before the batch is split, so that the list's
rows are what the towers share. A list or tuple is a value when it holds
only numbers, strings, bools, numpy scalars or lists and tuples of those;
one holding a tensor, a numpy array or a dict is a structure, as
`tf.nest` sees it.
"""

import collections.abc
import copy
from typing import Any, Sequence, Tuple

import numpy as np
import tensorflow as tf

_SCALARS = (int, float, complex, bool, str, bytes, np.generic)


def _is_value(sequence: Sequence[Any]) -> bool:
  """Whether a list or tuple holds only numbers, strings and lists of those."""
  if hasattr(sequence, "_fields"):  # a namedtuple is always a structure
    return False
  pending = [sequence]
  while pending:
    items = pending.pop()
    for item in items:
      if isinstance(item, (list, tuple)) and not hasattr(item, "_fields"):
        pending.append(item)
      elif not isinstance(item, _SCALARS) and not (isinstance(item, np.ndarray)
                                                   and item.ndim == 0):
        return False
  return True


def _convert(path: str, value: Any) -> tf.Tensor:
  try:
    return tf.convert_to_tensor(value)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"`{path}` is a Python {type(value).__name__} that TensorFlow cannot "
        f"convert to a tensor ({e}); give it rows of one length and one type, "
        "or pass a tf.RaggedTensor or tf.SparseTensor.") from None


def _converted(structure: Any, path: str) -> Tuple[Any, bool]:
  """`structure` with its value lists as tensors, and whether any was."""
  if isinstance(structure, (list, tuple)):
    if _is_value(structure):
      return _convert(path, structure), True
    items = [
        _converted(item, f"{path}[{i}]") for i, item in enumerate(structure)
    ]
    if not any(changed for _, changed in items):
      return structure, False
    values = [item for item, _ in items]
    if hasattr(structure, "_fields"):
      return type(structure)(*values), True
    return type(structure)(values), True
  if isinstance(structure, collections.abc.Mapping):
    entries = {
        key: _converted(value, f"{path}[{key!r}]")
        for key, value in structure.items()
    }
    if not any(changed for _, changed in entries.values()):
      return structure, False
    if isinstance(structure, collections.abc.MutableMapping):
      result = copy.copy(structure)
      for key, (value, _) in entries.items():
        result[key] = value
      return result, True
    converted = {k: v for k, (v, _) in entries.items()}
    # Mapping's stub takes no arguments; the concrete type takes a dict.
    return type(structure)(converted), True  # type: ignore[call-arg]
  return structure, False


def as_tensors(structure: Any, path: str) -> Any:
  """`structure` with every Python list or tuple that is a value a tensor.

  Converted as `tf.convert_to_tensor` converts it (what a feature column or
  a head does with it on one device); containers on the way are copied,
  everything else is left as it is.

  Raises:
    ValueError: a value list TensorFlow cannot convert (rows of different
      lengths, mixed types), naming it.
  """
  return _converted(structure, path)[0]
