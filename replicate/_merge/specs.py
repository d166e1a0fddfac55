"""Merging the towers' EstimatorSpecs into one.

Every tower computes one device's values of everything that does not hold
rows (`_meet.rewiring`): the loss, the metrics' updates and values, summaries,
the optimizer's update (built once, by tower 0). So the merged spec is
tower 0's, its train_op, loss, eval_metric_ops, hooks and scaffold
included (the other towers' copies of those never run), with the values
that hold rows merged: predictions and export outputs (and a
TPUEstimatorSpec's host-call tensors) are the towers' rows concatenated in
order, those computed on phantom rows (see `_prepare.split`) left out.
"""

import re
from typing import Any, Dict, List, Optional, Sequence

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate._batch import row_kinds
from replicate._meet import combining
from replicate._meet import optimizer_calls
from replicate._merge import hooks
from replicate._merge import tpu as _tpu
from replicate._prepare import split

_ModeKeys = tf.estimator.ModeKeys
_export = tf.estimator.export

# What TensorFlow accepts as an op name (its own check, in ops.py); a name
# with an empty path segment ('a//b', 'a/') would leave the merge's scope.
_OP_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*")
_INVALID_RUN = re.compile(r"[^A-Za-z0-9_.>-]+")


def concat_name(key: Any) -> str:
  """The name of the op concatenating one prediction or export output.

  `concat_<key>` where that is a valid op name, as before; any other key a
  plain Estimator accepts (a tuple such as MultiHead's ('head', 'logits'),
  a string with spaces, slashes at the ends or non-ASCII letters) gets its
  parts joined by '_' and each run of other characters made one '_'.
  TensorFlow makes repeated names unique, so two keys may share a name.
  """
  name = f"concat_{key}"
  if isinstance(key,
                str) and _OP_NAME.fullmatch(name) and ("//" not in name and
                                                       not name.endswith("/")):
    return name
  parts = key if isinstance(key, tuple) else (key,)
  return "concat_" + _INVALID_RUN.sub("_", "_".join(str(p) for p in parts))


def _merged(tensors: Sequence[Any], path: str, name: str,
            replication: _context.Replication) -> Any:
  """One device's value of a per-tower output: tower 0's, or the rows.

  Raises:
    ValueError: the value is computed per tower and has no rows to
      concatenate, nor a whole-batch value.
  """
  if any(t is None for t in tensors):
    return None
  rewiring = replication.rewiring
  tensors = [rewiring.resolve(t) for t in tensors]
  first = tensors[0]
  if isinstance(first, tf.SparseTensor):
    kind = rewiring.kind(first.values)
  elif isinstance(first, tf.RaggedTensor):
    kind = rewiring.kind(first.flat_values)
  else:
    first = tf.convert_to_tensor(first)
    kind = rewiring.kind(first)
  if row_kinds.shares_value(kind):
    return first
  if isinstance(kind, row_kinds.Size):
    with _context.outside(replication):
      return rewiring.whole_size(first)
  if not isinstance(kind, row_kinds.Rows) or kind.axis != 0 or kind.order:
    raise ValueError(optimizer_calls.not_whole_batch(first, kind, path))
  parts = combining.real_rows(tensors, replication, examples=True)
  if isinstance(first, tf.SparseTensor):
    return tf.sparse.concat(axis=0, sp_inputs=parts, expand_nonconcat_dims=True)
  if isinstance(first, tf.RaggedTensor):
    return tf.concat(parts, axis=0, name=name)
  merged = tf.concat(
      split.padded_to_widest([tf.convert_to_tensor(t) for t in parts]),
      axis=0,
      name=name)
  if all(isinstance(s, int) for s in replication.sizes) and (merged.shape.rank):
    # The batch's size, known when built (the shards hide theirs).
    merged.set_shape([sum(replication.sizes)] + [None] *
                     (merged.shape.rank - 1))
  return merged


def concat_predictions(predictions: Sequence[Any],
                       replication: _context.Replication) -> Any:
  """Concatenates every tower's predictions (a dict or one tensor).

  Args:
    predictions: each tower's predictions.
    replication: the towers: a scalar prediction computed from their inputs
      is refused, any other scalar is tower 0's; phantom rows are left out.
  """
  if predictions[0] is None:
    return None
  if isinstance(predictions[0], dict):
    return {
        key:
            _merged([p[key] for p in predictions], f"predictions[{key!r}]",
                    concat_name(key), replication) for key in predictions[0]
    }
  return _merged(predictions, "predictions", "concat_predictions", replication)


def _concat_export_output(outputs: Sequence[Any], path: str,
                          replication: _context.Replication) -> Any:
  first = outputs[0]
  if isinstance(first, _export.ClassificationOutput):
    return _export.ClassificationOutput(
        scores=_merged([o.scores for o in outputs], f"{path}.scores",
                       "concat_scores", replication),
        classes=_merged([o.classes for o in outputs], f"{path}.classes",
                        "concat_classes", replication))
  if isinstance(first, _export.RegressionOutput):
    return _export.RegressionOutput(
        value=_merged([o.value for o in outputs], f"{path}.value",
                      "concat_value", replication))
  if isinstance(first, _export.PredictOutput):
    return _export.PredictOutput({
        key:
            _merged([o.outputs[key]
                     for o in outputs], f"{path}.outputs[{key!r}]",
                    concat_name(key), replication) for key in first.outputs
    })
  raise ValueError(
      f"Export output {first!r} of type {type(first).__name__} cannot be "
      "merged across towers; use a PredictOutput, RegressionOutput or "
      "ClassificationOutput.")


def concat_export_outputs(
    export_outputs: Sequence[Dict[str, Any]],
    replication: _context.Replication) -> Optional[Dict[str, Any]]:
  """Concatenates every tower's export outputs, key by key (see above)."""
  if export_outputs[0] is None:
    return None
  return {
      key:
          _concat_export_output([e[key] for e in export_outputs],
                                f"export_outputs[{key!r}]", replication)
      for key in export_outputs[0]
  }


def check_same_metrics(specs: Sequence[Any]) -> None:
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


def _resolved(replication: _context.Replication, value: Any) -> Any:
  if isinstance(value, tf.Tensor):
    return replication.rewiring.resolve(value)
  return value


def _whole_loss(loss: tf.Tensor,
                replication: _context.Replication) -> tf.Tensor:
  """Tower 0's loss, which is the whole batch's (see `_meet.rewiring`)."""
  loss = replication.rewiring.resolve(loss)
  kind = replication.rewiring.kind(loss)
  if row_kinds.shares_value(kind):
    return loss
  if isinstance(kind, row_kinds.Size):
    return replication.rewiring.whole_size(loss)
  raise ValueError(
      optimizer_calls.not_whole_batch(loss, kind,
                                      "the loss the model_fn returned"))


def _whole_summaries(replication: _context.Replication) -> None:
  """The summaries TensorBoard shows are tower 0's, with their whole batch's
  values; one that is not (a value of tower 0's own) is logged."""
  summaries = replication.graph.get_collection_ref(
      tf.compat.v1.GraphKeys.SUMMARIES)
  rewiring = replication.rewiring
  for position, summary in enumerate(summaries):
    if not isinstance(summary, tf.Tensor):
      continue
    summaries[position] = rewiring.resolve(summary)
    kind = rewiring.kind(summary)
    if isinstance(kind, row_kinds.Local):
      logging.warning(
          "replicate: summary %s shows tower 0's own value, not the whole "
          "batch's: op %s %s; summarise the whole batch's rows or a "
          "reduction over them instead", summary.op.name, kind.op, kind.why)


def merge_specs(mode: str, specs: List[Any],
                replication: _context.Replication) -> Any:
  """Builds the one EstimatorSpec the Estimator sees (see above).

  TPUEstimatorSpecs merge into one (see `_merge.tpu`): `eval_metrics` and
  `host_call` get the towers' rows concatenated, as a TPU's shards'.

  Raises:
    ValueError: the loss, a prediction or an export output is computed per
      tower in a way that is not the whole batch's.
  """
  tpu = _tpu.is_tpu_spec(specs[0])
  check_same_metrics(specs)
  with _context.outside(replication, "merge_towers"), \
      tf.device(replication.consolidation_device):
    fields = {
        "predictions":
            concat_predictions([s.predictions for s in specs], replication)
    }
    loss = getattr(specs[0], "loss", None)
    if mode != _ModeKeys.PREDICT and isinstance(loss, tf.Tensor):
      fields["loss"] = _whole_loss(loss, replication)
    if mode == _ModeKeys.PREDICT:
      fields["export_outputs"] = concat_export_outputs(
          [s.export_outputs for s in specs], replication)
    if mode == _ModeKeys.EVAL and not tpu and specs[0].eval_metric_ops:
      fields["eval_metric_ops"] = {
          key: ((_resolved(replication, metric[0]),
                 metric[1]) if isinstance(metric, tuple) else metric
               ) for key, metric in specs[0].eval_metric_ops.items()
      }
    if tpu:
      fields.update(
          _tpu.merge_host_calls(
              specs, lambda tensors, path, name: _merged(
                  tensors, path, concat_name(name), replication)))
  _whole_summaries(replication)
  swaps = dict(replication.rewiring.replacements())
  swaps.update(hooks.whole_batch_swaps(specs[0], fields))
  for name in ("training_hooks", "training_chief_hooks", "evaluation_hooks",
               "prediction_hooks"):
    if name in specs[0]._fields:
      fields[name] = hooks.wrap_hooks(getattr(specs[0], name), swaps)
  if tpu:
    return _tpu.merged_spec(specs[0], fields)
  scaffold = _with_unseen_initialized(specs[0].scaffold, replication)
  if scaffold is not None:
    fields["scaffold"] = scaffold
  return specs[0]._replace(**fields)


def _with_unseen_initialized(
    scaffold: Optional[tf.compat.v1.train.Scaffold],
    replication: _context.Replication) -> Optional[tf.compat.v1.train.Scaffold]:
  """A scaffold whose own `local_init_op` (built in tower 0's call, AdaNet's)
  also initializes the variables tower 0 did not see; None if unchanged.

  The Estimator's default local initialization is made once the graph is
  complete and covers them already.
  """
  if scaffold is None or scaffold.local_init_op is None:
    return None
  unseen = replication.views.unseen_variables()
  if not unseen:
    return None
  with _context.outside(replication, "replicate_init"):
    local_init = tf.group(scaffold.local_init_op,
                          *[variable.initializer for variable in unseen])
  return tf.compat.v1.train.Scaffold(
      local_init_op=local_init, copy_from_scaffold=scaffold)
