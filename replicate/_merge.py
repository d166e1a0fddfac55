"""Merging the towers' EstimatorSpecs into one.

Every field but those below is tower 0's (hooks, scaffold: the unwrapped
model's names, none duplicated); the loss is the sum of the towers' scaled
losses, the train_op groups every tower's, predictions and export outputs
are concatenated along the batch (a scalar, which has no batch dimension,
is tower 0's where it does not depend on the batch, and refused where it
does), and each eval metric's variables are summed into tower 0's. A tower
that computed on a phantom row (see _split) adds no rows to predictions
and nothing to metrics.
"""

from typing import Any, Dict, List, Sequence

import tensorflow as tf

from replicate import _aggregate
from replicate import _context

_ModeKeys = tf.estimator.ModeKeys
_export = tf.estimator.export


def _reads_batch(tensor, inputs) -> bool:
  """Whether `tensor`'s value is computed from the towers' `inputs`."""
  batch_ops = {t.op for t in tf.nest.flatten(inputs, expand_composites=True)
               if t is not None}
  pending, seen = [tensor.op], set()
  while pending:
    op = pending.pop()
    if op in batch_ops:
      return True
    if op not in seen:
      seen.add(op)
      pending.extend(t.op for t in op.inputs)
  return False


def _tower_zero_scalar(scalar, path: str, inputs):
  """A scalar has no batch dimension: tower 0's, where the batch is not read.

  Raises:
    ValueError: the scalar is computed from the tower's shard of the batch.
  """
  if _reads_batch(scalar, inputs):
    raise ValueError(
        f"{path} is a scalar computed from the tower's share of the batch, "
        "so no tower holds the whole batch's value and the towers' values "
        "cannot be combined without knowing whether it is a mean, a sum or "
        "a maximum; give it a batch dimension (one value per example), "
        "report it in EVAL as a metric (e.g. tf.compat.v1.metrics.mean), or "
        "compute it from variables and constants only.")
  return scalar


def _first_rows(tensor, size):
  """The first `size` rows of a batch-major tensor."""
  if isinstance(tensor, tf.SparseTensor):
    start = tf.zeros_like(tensor.dense_shape)
    extent = tf.concat([[tf.cast(size, tf.int64)], tensor.dense_shape[1:]], 0)
    return tf.sparse.slice(tensor, start, extent)
  return tensor[:size]


def _real_rows(tensors: Sequence[Any], replication: _context.Replication):
  """The towers' outputs without the rows computed on phantom rows.

  A tower known to hold a phantom row is left out; one that may (the batch
  size is dynamic) keeps its first `size` rows: none, or all of them.
  """
  kept = []
  for index, tensor in enumerate(tensors):
    valid = replication.is_valid(index)
    if valid is True:
      kept.append(tensor)
    elif valid is not False:
      kept.append(_first_rows(tensor, replication.size(index)))
  return kept


def _concat(tensors: Sequence[Any], path: str, name: str,
            replication: _context.Replication):
  if any(t is None for t in tensors):
    return None
  if not isinstance(tensors[0], tf.SparseTensor) and (
      tensors[0].shape.rank == 0):
    return _tower_zero_scalar(tensors[0], path, replication.inputs)
  tensors = _real_rows(tensors, replication)
  if isinstance(tensors[0], tf.SparseTensor):
    return tf.sparse.concat(axis=0, sp_inputs=tensors)
  return tf.concat(tensors, axis=0, name=name)


def concat_predictions(predictions: Sequence[Any],
                       replication: _context.Replication):
  """Concatenates every tower's predictions (a dict or one tensor).

  Args:
    predictions: each tower's predictions.
    replication: the towers: a scalar prediction computed from their inputs
      is refused, any other scalar is tower 0's; phantom rows are left out.
  """
  if predictions[0] is None:
    return None
  if isinstance(predictions[0], dict):
    return {key: _concat([p[key] for p in predictions],
                         f"predictions[{key!r}]", f"concat_{key}",
                         replication)
            for key in predictions[0]}
  return _concat(predictions, "predictions", "concat_predictions", replication)


def _concat_export_output(outputs: Sequence[Any], path: str,
                          replication: _context.Replication):
  first = outputs[0]
  if isinstance(first, _export.ClassificationOutput):
    return _export.ClassificationOutput(
        scores=_concat([o.scores for o in outputs], f"{path}.scores",
                       "concat_scores", replication),
        classes=_concat([o.classes for o in outputs], f"{path}.classes",
                        "concat_classes", replication))
  if isinstance(first, _export.RegressionOutput):
    return _export.RegressionOutput(
        value=_concat([o.value for o in outputs], f"{path}.value",
                      "concat_value", replication))
  if isinstance(first, _export.PredictOutput):
    return _export.PredictOutput(
        {key: _concat([o.outputs[key] for o in outputs],
                      f"{path}.outputs[{key!r}]", f"concat_{key}", replication)
         for key in first.outputs})
  raise ValueError(
      f"Export output {first!r} of type {type(first).__name__} cannot be "
      "merged across towers; use a PredictOutput, RegressionOutput or "
      "ClassificationOutput.")


def concat_export_outputs(export_outputs: Sequence[Dict[str, Any]],
                          replication: _context.Replication):
  """Concatenates every tower's export outputs, key by key (see above)."""
  if export_outputs[0] is None:
    return None
  return {key: _concat_export_output([e[key] for e in export_outputs],
                                     f"export_outputs[{key!r}]", replication)
          for key in export_outputs[0]}


def _metric_variables_by_tower(replication: _context.Replication):
  """Per tower: creation key -> metric variable."""
  metric_refs = {v.ref() for v in tf.compat.v1.get_collection(
      tf.compat.v1.GraphKeys.METRIC_VARIABLES)}
  return [{key: var for key, var in created.items() if var.ref() in metric_refs}
          for created in replication.created]


def _real_contributions(replication: _context.Replication, variables):
  """Towers 1..N-1's values of one metric variable, phantom rows' left out.

  A tower that computed on a phantom row (see _split) adds zero.
  """
  return [_aggregate.gate(variable.read_value(), replication.is_valid(index))
          for index, variable in enumerate(variables, start=1)
          if replication.is_valid(index) is not False]


def _reduce_metric_variables(replication: _context.Replication, after):
  """One op that adds towers 1..N-1's metric variables into tower 0's.

  Runs after `after` (every tower's update ops) and zeroes the added
  variables, so tower 0's metric values cover the whole batch.
  """
  per_tower = _metric_variables_by_tower(replication)
  adds, added = [], []
  with tf.control_dependencies(after), tf.name_scope("metric_sum"):
    for key, target in per_tower[0].items():
      others = []
      for index, variables in enumerate(per_tower[1:], start=1):
        if key not in variables:
          raise ValueError(
              f"Eval metric variable {target.op.name!r} of tower 0 has no "
              f"counterpart in tower {index}; every tower must return the "
              "same eval_metric_ops built the same way.")
        others.append(variables[key])
      contributions = _real_contributions(replication, others)
      if contributions:
        adds.append(target.assign_add(tf.add_n(contributions),
                                      read_value=False))
      added.extend(others)
    # Still after `after` where nothing is added (phantom towers only).
    with tf.control_dependencies(adds):
      zeroes = [v.assign(tf.zeros_like(v), read_value=False) for v in added]
  return tf.group(*adds, *zeroes, name="reduce_metric_variables")


def merge_eval_metric_ops(specs, replication: _context.Replication):
  """Tower 0's metric values, updated by every tower's update ops."""
  keys = [sorted(spec.eval_metric_ops or {}) for spec in specs]
  for index, tower_keys in enumerate(keys[1:], start=1):
    if tower_keys != keys[0]:
      raise ValueError(
          f"Tower {index} returned eval_metric_ops {tower_keys} but tower 0 "
          f"returned {keys[0]}; every tower must return the same metrics.")
  if not keys[0]:
    return specs[0].eval_metric_ops
  updates = [spec.eval_metric_ops[key][1] for spec in specs for key in keys[0]]
  reduce_op = _reduce_metric_variables(replication, updates)
  return {key: (specs[0].eval_metric_ops[key][0], reduce_op)
          for key in keys[0]}


def _watch_merged_loss(hooks, tower_loss, loss):
  """Tower 0's hooks that watch its loss watch the whole batch's instead.

  A `LoggingTensorHook` or `NanTensorHook` built on the loss in the
  model_fn then logs, or guards, what it would on one device.
  """
  tower_name = getattr(tower_loss, "name", None)
  is_tower_loss = lambda t: getattr(t, "name", t) == tower_name
  for hook in hooks or ():
    # Both hooks keep what they watch in private attributes, read in begin().
    if isinstance(hook, tf.compat.v1.train.LoggingTensorHook):
      hook._tensors = {  # pylint: disable=protected-access
          tag: loss if is_tower_loss(t) else t
          for tag, t in hook._tensors.items()}  # pylint: disable=protected-access
    elif isinstance(hook, tf.compat.v1.train.NanTensorHook) and is_tower_loss(
        hook._loss_tensor):  # pylint: disable=protected-access
      hook._loss_tensor = loss  # pylint: disable=protected-access


def merge_specs(mode, specs: List[Any], replication: _context.Replication):
  """Builds the one EstimatorSpec the Estimator sees, on the hub device."""
  with tf.device(replication.hub), tf.name_scope("merge_towers"):
    fields = {"predictions": concat_predictions([s.predictions for s in specs],
                                                replication)}
    if mode != _ModeKeys.PREDICT:
      fields["loss"] = _aggregate.sum_losses([
          _aggregate.scale_loss(s.loss, replication.loss_reduction,
                                replication.fraction(i), replication.size(i))
          for i, s in enumerate(specs)])
    if mode == _ModeKeys.TRAIN:
      # The last tower's train_op applies the summed gradients; every
      # tower's runs, with whatever the model_fn tied to it.
      fields["train_op"] = tf.group(*[s.train_op for s in specs],
                                    name="train_op")
    if mode == _ModeKeys.EVAL:
      fields["eval_metric_ops"] = merge_eval_metric_ops(specs, replication)
    if mode == _ModeKeys.PREDICT:
      fields["export_outputs"] = concat_export_outputs(
          [s.export_outputs for s in specs], replication)
  if mode != _ModeKeys.PREDICT:
    for hooks in (specs[0].training_hooks, specs[0].training_chief_hooks,
                  specs[0].evaluation_hooks):
      _watch_merged_loss(hooks, specs[0].loss, fields["loss"])
  return specs[0]._replace(**fields)
