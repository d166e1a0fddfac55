"""Merging the towers' EstimatorSpecs into one.

Every field but those below is tower 0's (hooks, scaffold: the unwrapped
model's names, none duplicated; hooks fetch the whole batch's loss and
predictions); the loss is the whole batch's (`_loss`), the train_op groups
every tower's, predictions and export outputs are concatenated along the
batch (a scalar, which has no batch dimension, is tower 0's where it does
not depend on the batch, and refused where it does; a tower that computed
on a phantom row, see _split, adds no rows), and each eval metric is tower
0's value, its update op running every tower's (the towers' writes to the
shared metric variables are combined in `_state`).
"""

import re
from typing import Any, Dict, List, Sequence

import tensorflow as tf

from replicate import _context
from replicate import _hooks
from replicate import _loss
from replicate import _split
from replicate import _tpu
from replicate._inputs import reads_batch as _reads_batch

_ModeKeys = tf.estimator.ModeKeys
_export = tf.estimator.export


# What TensorFlow accepts as an op name (its own check, in ops.py); a name
# with an empty path segment ('a//b', 'a/') would leave the merge's scope.
_OP_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*")
_INVALID_RUN = re.compile(r"[^A-Za-z0-9_.>-]+")


def concat_name(key) -> str:
  """The name of the op concatenating one prediction or export output.

  `concat_<key>` where that is a valid op name, as before; any other key a
  plain Estimator accepts (a tuple such as MultiHead's ('head', 'logits'),
  a string with spaces, slashes at the ends or non-ASCII letters) gets its
  parts joined by '_' and each run of other characters made one '_'.
  TensorFlow makes repeated names unique, so two keys may share a name.
  """
  name = f"concat_{key}"
  if isinstance(key, str) and _OP_NAME.fullmatch(name) and (
      "//" not in name and not name.endswith("/")):
    return name
  parts = key if isinstance(key, tuple) else (key,)
  return "concat_" + _INVALID_RUN.sub("_", "_".join(str(p) for p in parts))


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


def real_rows(tensors: Sequence[Any], replication: _context.Replication):
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
  tensors = real_rows(tensors, replication)
  if isinstance(tensors[0], tf.SparseTensor):
    # Shards of a variable-length feature differ in width (see _split).
    return tf.sparse.concat(axis=0, sp_inputs=tensors,
                            expand_nonconcat_dims=True)
  return tf.concat(_split.padded_to_widest(tensors), axis=0, name=name)


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
                         f"predictions[{key!r}]", concat_name(key),
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
                      f"{path}.outputs[{key!r}]", concat_name(key),
                      replication)
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


def _after_every_tower(updates: Sequence[Any]):
  """Tower 0's update op, made to wait for every tower's.

  An op becomes a group; anything else (a tensor, or the variable an
  assign returns) a tensor of the metric's value after the update, as the
  unwrapped model_fn's update op gives it.
  """
  first, others = updates[0], updates[1:]
  if isinstance(first, tf.Operation):
    return tf.group(first, *others)
  with tf.control_dependencies(others):
    return tf.identity(first)


def check_same_metrics(specs):
  """Every tower must return the same eval_metric_ops keys.

  Checked before the towers' state writes are combined, whose error about
  a metric variable only one tower writes would hide this cause.
  """
  if _tpu.is_tpu_spec(specs[0]):
    field, keys = "eval_metrics", [_tpu.metric_keys(spec) for spec in specs]
  else:
    field = "eval_metric_ops"
    keys = [sorted(spec.eval_metric_ops or {}) for spec in specs]
  for index, tower_keys in enumerate(keys[1:], start=1):
    if tower_keys != keys[0]:
      raise ValueError(
          f"Tower {index} returned {field} {tower_keys} but tower 0 "
          f"returned {keys[0]}; every tower must return the same metrics.")


def merge_eval_metric_ops(specs):
  """Tower 0's metric values; each update op runs every tower's.

  The towers share the metric variables and their writes are made one
  write per step by each variable's aggregation (`_state`), so tower 0's
  values are the whole batch's.
  """
  check_same_metrics(specs)
  if not specs[0].eval_metric_ops:
    return specs[0].eval_metric_ops
  return {key: (value, _after_every_tower(
      [spec.eval_metric_ops[key][1] for spec in specs]))
          for key, (value, _) in specs[0].eval_metric_ops.items()}


def merge_specs(mode, specs: List[Any], replication: _context.Replication):
  """Builds the one EstimatorSpec the Estimator sees, on the hub device.

  TPUEstimatorSpecs merge into one (see `_tpu`): `eval_metrics` and
  `host_call` get the towers' tensors concatenated, as a TPU's shards'.
  """
  tpu = _tpu.is_tpu_spec(specs[0])
  with tf.device(replication.hub), tf.name_scope("merge_towers"):
    fields = {"predictions": concat_predictions([s.predictions for s in specs],
                                                replication)}
    if mode != _ModeKeys.PREDICT:
      fields["loss"] = _loss.combine(replication, [s.loss for s in specs])
    if mode == _ModeKeys.TRAIN:
      # Tower 0's train_op applies the whole batch's gradients; every
      # tower's runs, with whatever the model_fn tied to it.
      fields["train_op"] = tf.group(*[s.train_op for s in specs],
                                    name="train_op")
    if mode == _ModeKeys.EVAL and not tpu:
      fields["eval_metric_ops"] = merge_eval_metric_ops(specs)
    if mode == _ModeKeys.PREDICT:
      fields["export_outputs"] = concat_export_outputs(
          [s.export_outputs for s in specs], replication)
    if tpu:
      fields.update(_tpu.merge_host_calls(
          specs, replication, fields.get("loss"),
          lambda tensors, path, name: _concat(tensors, path,
                                              concat_name(name), replication),
          lambda tensor: _reads_batch(tensor, replication.inputs)))
  swaps = _hooks.whole_batch_swaps(specs[0], fields)
  for name in ("training_hooks", "training_chief_hooks", "evaluation_hooks",
               "prediction_hooks"):
    if name in specs[0]._fields:
      fields[name] = _hooks.wrap_hooks(getattr(specs[0], name), swaps)
  if tpu:
    return _tpu.merged_spec(specs[0], fields)
  return specs[0]._replace(**fields)
