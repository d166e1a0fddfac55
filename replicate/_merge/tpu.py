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

from typing import Any, Callable, Dict, List, Sequence, Tuple

from absl import logging
import tensorflow as tf

from replicate._prepare import split

_BATCH_SIZE = "batch_size"
_USE_TPU = "use_tpu"
# The spec's functions and their batch-major tensors.
_HOST_CALLS = ("eval_metrics", "host_call")


def _spec_class() -> Any:
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec


def is_tpu_spec(spec: Any) -> bool:
  """Whether a model_fn returned a `TPUEstimatorSpec`."""
  return isinstance(spec, _spec_class())


def _under_tpu_estimator(params: Any, config: Any) -> bool:
  """Whether TPUEstimator calls the model_fn: it always sets 'use_tpu'.

  TPUEstimator requires a `tf.compat.v1.estimator.tpu.RunConfig`, passes
  it on, and adds 'use_tpu' (and, but for exports, 'batch_size') to params.
  """
  return (isinstance(config, tf.compat.v1.estimator.tpu.RunConfig) and
          isinstance(params, dict) and _USE_TPU in params)


def tower_params(params: Any, config: Any, index: int, num_towers: int) -> Any:
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
  sizes = split.shard_sizes(batch_size, num_towers)
  if index == 0:
    logging.info(
        "replicate: TPUEstimator's params['batch_size'] %d given to "
        "%d towers as their shards' sizes %s", batch_size, num_towers, sizes)
  params[_BATCH_SIZE] = max(sizes[index], min(batch_size, 1))
  return params


def as_estimator_spec(spec: Any, params: Any) -> Any:
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


def _rebuilt(spec: Any, fields: Dict[str, Any]) -> Any:
  values = spec._asdict()
  values.update(fields)
  return _spec_class()(**values)


def metric_keys(spec: Any) -> List[str]:
  """The names of `spec`'s eval_metrics tensors, for comparing towers."""
  if not spec.eval_metrics:
    return []
  tensors = spec.eval_metrics[1]
  if isinstance(tensors, dict):
    return sorted(tensors)
  return [f"eval_metrics tensor {i}" for i in range(len(tensors))]


# `merge(tensors, path, name)`: one device's value of the towers' tensors.
_Merge = Callable[[List[Any], str, str], Any]


def _merge_host_call(calls: Sequence[Tuple[Callable[..., Any], Any]], name: str,
                     merge: _Merge) -> Tuple[Callable[..., Any], Any]:
  """(fn, tensors) with each tensor merged across the towers."""
  fn, first = calls[0]
  keys = list(first) if isinstance(first, dict) else range(len(first))
  merged = [
      merge([c[1][key]
             for c in calls], f"{name}[1][{key!r}]", f"{name}_{key}")
      for key in keys
  ]
  if isinstance(first, dict):
    return (fn, dict(zip(keys, merged)))
  return (fn, merged)


def merge_host_calls(specs: Sequence[Any], merge: _Merge) -> Dict[str, Any]:
  """The merged spec's `eval_metrics` and `host_call`.

  Args:
    specs: the towers' TPUEstimatorSpecs.
    merge: `merge(tensors, path, name)`: one device's value of the towers'
      tensors (tower 0's where it is the whole batch's, such as
      `tf.reshape(loss, [1])`; the rows concatenated where they hold rows).
  """
  fields = {}
  for name in _HOST_CALLS:
    calls = [getattr(spec, name) for spec in specs]
    if calls[0] is not None:
      fields[name] = _merge_host_call(calls, name, merge)
  return fields


def merged_spec(tower_spec: Any, fields: Dict[str, Any]) -> Any:
  """Tower 0's TPUEstimatorSpec with the merged fields (its scaffold_fn)."""
  fields = {
      key: value for key, value in fields.items() if key in tower_spec._fields
  }
  return _rebuilt(tower_spec, fields)
