"""TPU-style model_fns (returning `TPUEstimatorSpec`) run as towers.

Research code written for TPUs (BERT's run_classifier.py) runs on GPUs in
`TPUEstimator(use_tpu=False)`, which converts the model_fn's
`TPUEstimatorSpec` with `as_estimator_spec()`: `metric_fn(*tensors)` gives
the eval_metric_ops, `host_call` a hook, `scaffold_fn()` the scaffold. The
towers' specs are merged as a TPU merges its shards': the `eval_metrics` and
`host_call` tensors (batch-major) are concatenated and their functions called
once, on the whole batch's; `scaffold_fn` is tower 0's, called once. The
merged spec is then converted the same way, under TPUEstimator and in a
plain Estimator (which does not accept a `TPUEstimatorSpec`) alike.

Under TPUEstimator, `params['batch_size']` is the batch the model_fn sees
(TPU code shapes tensors with it); each tower is given its shard's size.
"""

from typing import Any, Dict, List, Sequence

import tensorflow as tf
from absl import logging

from replicate import _context
from replicate import _split

_BATCH_SIZE = "batch_size"
_USE_TPU = "use_tpu"
# The spec's functions and their batch-major tensors.
_HOST_CALLS = ("eval_metrics", "host_call")


def _spec_class():
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec


def is_tpu_spec(spec) -> bool:
  """Whether a model_fn returned a `TPUEstimatorSpec`."""
  return isinstance(spec, _spec_class())


def _under_tpu_estimator(params, config) -> bool:
  """Whether TPUEstimator calls the model_fn: it always sets 'use_tpu'.

  TPUEstimator requires a `tf.compat.v1.estimator.tpu.RunConfig`, passes
  it on, and adds 'use_tpu' (and, but for exports, 'batch_size') to params.
  """
  return (isinstance(config, tf.compat.v1.estimator.tpu.RunConfig) and
          isinstance(params, dict) and _USE_TPU in params)


def tower_params(params, config, index: int, num_towers: int):
  """Tower `index`'s params: under TPUEstimator, its shard's batch size.

  TPUEstimator sets `params['batch_size']` to the batch each model_fn call
  sees (a core's shard on a TPU, the whole batch on one device). Each tower
  gets its shard of that batch, split as the inputs are (sizes differing by
  at most one, the larger first; a tower left a phantom row gets 1), so
  `tf.reshape(x, [params['batch_size'], ...])` fits its shard. `params` is
  the tower's own copy; other params are left as they are.
  """
  if not _under_tpu_estimator(params, config):
    return params
  batch_size = params.get(_BATCH_SIZE)
  if not isinstance(batch_size, int):
    return params
  sizes = _split.shard_sizes(batch_size, num_towers)
  if index == 0:
    logging.info("replicate: TPUEstimator's params['batch_size'] %d given to "
                 "%d towers as their shards' sizes %s", batch_size,
                 num_towers, sizes)
  params[_BATCH_SIZE] = max(sizes[index], min(batch_size, 1))
  return params


def as_estimator_spec(spec, params):
  """The EstimatorSpec TPUEstimator(use_tpu=False) would make of `spec`.

  Anything but a `TPUEstimatorSpec`, and one made for a TPU
  (`params['use_tpu']` true: TPUEstimator's TPU paths, e.g. an export for
  TPU inference, take the spec itself), is returned as it is.
  """
  if not is_tpu_spec(spec):
    return spec
  if isinstance(params, dict) and params.get(_USE_TPU):
    return spec
  logging.info("replicate: converting the model_fn's TPUEstimatorSpec as "
               "TPUEstimator(use_tpu=False) does (as_estimator_spec)")
  # TPUEstimatorSpec keeps its host calls on the class, set by the latest
  # spec built; rebuilding this one makes them its own again.
  return _rebuilt(spec, {}).as_estimator_spec()


def _rebuilt(spec, fields: Dict[str, Any]):
  values = spec._asdict()
  values.update(fields)
  return _spec_class()(**values)


def metric_keys(spec) -> List[str]:
  """The names of `spec`'s eval_metrics tensors, for comparing towers."""
  if not spec.eval_metrics:
    return []
  tensors = spec.eval_metrics[1]
  if isinstance(tensors, dict):
    return sorted(tensors)
  return [f"eval_metrics tensor {i}" for i in range(len(tensors))]


def _loss_shaped(tensor, tower_loss, whole_loss):
  """The whole batch's loss shaped as `tensor`, if `tensor` is the tower's.

  TPU code hands its loss to a host call as `tf.reshape(loss, [1])`: not one
  row per example, so it is not concatenated but is the whole batch's loss.
  """
  if tower_loss is None or whole_loss is None:
    return None
  if tensor is tower_loss:
    return whole_loss
  op = tensor.op
  if op.type in ("Reshape", "ExpandDims", "Identity") and (
      op.inputs[0] is tower_loss):
    return tf.reshape(whole_loss, tf.shape(tensor))
  return None


def _rows_differ(tensors, replication):
  """(tower, rows, size) where a tower's tensor is not one row per example.

  None where every tower's is. Only statically known row counts are compared; a phantom row's tower is
  left out of the concatenation, so it is not compared.
  """
  for index, tensor in enumerate(tensors):
    rows = tf.compat.dimension_value(tensor.shape[0])
    size = replication.size(index)
    if (rows is not None and isinstance(size, int) and size and
        rows != size and replication.is_valid(index) is True):
      return index, rows, size
  return None


def _not_batch_major(tensors, path: str, replication, reads_batch):
  """Tower 0's tensor where it has no row per example and reads no input.

  Such a tensor (`tf.reshape(global_step, [1])`) is the same in every
  tower. One that reads the batch is refused: its towers' values cannot be
  made one device's.
  """
  differ = _rows_differ(tensors, replication)
  if differ is None:
    return None
  if not reads_batch(tensors[0]):
    return tensors[0]
  index, rows, size = differ
  raise ValueError(
      f"{path} has {rows} rows in tower {index}, which holds {size} "
      "examples: TPUEstimatorSpec's eval_metrics and host_call tensors "
      "must be batch-major (one row per example), as on a TPU, whose "
      "shards' tensors are concatenated; pass per-example values (the "
      "loss itself, or tf.reshape(loss, [1]), is recognised as the whole "
      "batch's loss).")


def _merge_tensors(per_tower: Sequence[Any], path: str, name: str,
                   replication, losses, helpers):
  """One host-call tensor: the whole batch's loss, tower 0's, or the rows."""
  concat, reads_batch = helpers
  tensors = [tf.convert_to_tensor(t) for t in per_tower]
  whole = _loss_shaped(tensors[0], losses[0], losses[1])
  if whole is not None:
    return whole
  if tensors[0].shape.rank:
    same = _not_batch_major(tensors, path, replication, reads_batch)
    if same is not None:
      return same
  return concat(tensors, path, name)


def _merge_host_call(calls, name: str, replication, losses, helpers):
  """(fn, tensors) with each tensor the towers' concatenated along rows."""
  fn, first = calls[0]
  keys = list(first) if isinstance(first, dict) else range(len(first))
  merged = [_merge_tensors([c[1][key] for c in calls],
                           f"{name}[1][{key!r}]", f"{name}_{key}",
                           replication, losses, helpers) for key in keys]
  if isinstance(first, dict):
    return (fn, dict(zip(keys, merged)))
  return (fn, merged)


def merge_host_calls(specs: Sequence[Any], replication: _context.Replication,
                     loss, concat, reads_batch) -> Dict[str, Any]:
  """The merged spec's `eval_metrics` and `host_call` (see above).

  Args:
    specs: the towers' TPUEstimatorSpecs.
    replication: the towers.
    loss: the whole batch's loss (None in PREDICT).
    concat: `concat(tensors, path, name)` concatenating the towers' rows
      (a scalar: tower 0's where it reads no input, else refused).
    reads_batch: `reads_batch(tensor)`, whether it reads the towers' inputs.
  """
  fields = {}
  losses = (specs[0].loss, loss)
  for name in _HOST_CALLS:
    calls = [getattr(spec, name) for spec in specs]
    if calls[0] is not None:
      fields[name] = _merge_host_call(calls, name, replication, losses,
                                      (concat, reads_batch))
  return fields


def merged_spec(tower_spec, fields: Dict[str, Any]):
  """Tower 0's TPUEstimatorSpec with the merged fields (its scaffold_fn)."""
  fields = {key: value for key, value in fields.items()
            if key in tower_spec._fields}
  return _rebuilt(tower_spec, fields)
