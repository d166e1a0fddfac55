"""replicate_model_fn: one model_fn, run as one tower per device.

One call reads top-down: resolve devices; split the inputs on the
consolidation device; build each tower to its end, one after another,
tower 0 last (`_towers.build`): calls that need every tower meet
(`_meet.meetings`: optimizer calls, wrapped or routed by `_meet.routing`,
gradients the model_fn takes itself, batch_sum / batch_concat), and tower 0, the
last to arrive, builds each once; make every batch reduction of every tower the
whole batch's (`_meet.rewiring`); check that the towers built the same model and
that an update was applied; make the towers' state writes one device's
(`_merge.state`); merge the specs (`_merge.specs`).
"""

import contextlib
import copy
import inspect
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from absl import logging
import tensorflow as tf

from replicate import _context
from replicate import _graph
from replicate import _tf
from replicate._batch import sums
from replicate._batch_norm import per_tower
from replicate._meet import meetings
from replicate._meet import own_gradients
from replicate._meet import rewiring
from replicate._meet import routing
from replicate._meet import trainers as _trainers
from replicate._merge import mirrored as _mirrored
from replicate._merge import specs as _specs
from replicate._merge import state
from replicate._merge import tpu
from replicate._prepare import cluster
from replicate._prepare import devices as _devices
from replicate._prepare import origin
from replicate._prepare import split as _split
from replicate._towers import build
from replicate._towers import lookups
from replicate._towers import views

_ModeKeys = tf.estimator.ModeKeys
_PLACEHOLDER_OPS = frozenset(["Placeholder"])


def replicate_model_fn(
    model_fn: Callable[..., tf.estimator.EstimatorSpec],
    loss_reduction: str = tf.compat.v1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS,
    devices: Optional[Sequence[str]] = None,
    variable_placement: Union[_devices.VariablePlacement, str, None] = None,
    sync_batch_norm: bool = True,
) -> Callable[..., tf.estimator.EstimatorSpec]:
  """Wraps an Estimator model_fn to run one tower per device.

  Each batch of features and labels is split along dimension 0 across the
  devices; the model_fn runs once per device with one shared set of
  variables; the optimizer (as it is, or in `replicate.TowerOptimizer`)
  is called once per step with the whole batch's loss, as on one device.
  Losses, gradients, metrics and predictions equal those of one device on
  the whole batch, and checkpoints are interchangeable with the unwrapped
  model_fn's.

      est = tf.estimator.Estimator(replicate.replicate_model_fn(model_fn))

  Args:
    model_fn: an Estimator model_fn taking `features`, `labels`, `mode` and
      optionally `params` and `config`.
    loss_reduction: how the model_fn reduces its loss over a batch, a
      `tf.compat.v1.losses.Reduction` (or Keras reduction name), as
      tf.contrib's `replicate_model_fn` asked. Nothing depends on it: the
      whole batch's loss is built from the model_fn's own ops, whatever
      its form; it is only checked to be a reduction.
    devices: device names, e.g. ['/device:GPU:0', '/device:GPU:1']; None
      means every local GPU, or the host CPU when there is none. Names of
      this process's devices are checked against the local devices (and
      the CPUs `config.session_config` asks for) when the model_fn runs;
      called without `config`, CPUs only the caller's session can make are
      accepted with a warning.
    variable_placement: a `replicate.VariablePlacement` (or its string):
      SHARED keeps every variable on the consolidation device, ROUND_ROBIN
      spreads them over the towers' devices, MIRRORED keeps a copy of each
      trained variable on every tower device. None (the default) means
      MIRRORED for GPU towers and SHARED otherwise.
    sync_batch_norm: whether batch normalization in training (Keras
      `BatchNormalization`, `tf.compat.v1.layers.batch_normalization`, the
      canned DNN estimators' `batch_norm=True`, and `tf.nn.moments`,
      `tf.nn.weighted_moments` and `tf.compat.v1.nn.fused_batch_norm` in
      training over the batch axis 0) normalises with the whole batch's
      statistics, as on one device (default), or with each tower's shard's
      (False: fewer meeting points, not one device's result).

  Returns:
    A model_fn `(features, labels, mode, params=None, config=None)`.

  Raises:
    TypeError: `model_fn` is not callable, `loss_reduction` is not a
      string, `devices` is not a list of strings, `variable_placement` is
      neither a `VariablePlacement` nor a string, or `sync_batch_norm` is
      not a bool.
    ValueError: the reduction is unknown, a device name is bad or
      repeated, the placement is unknown, or `TF_CONFIG` is not JSON or
      names a task its cluster does not have. The returned model_fn raises
      it for a device that does not exist locally or is on another task of
      the cluster.
  """
  if not callable(model_fn):
    raise TypeError(
        f"model_fn={model_fn!r} is of type {type(model_fn).__name__}, not a "
        "function; pass the model_fn you give tf.estimator.Estimator (for a "
        "canned estimator, its .model_fn).")
  if not isinstance(sync_batch_norm, bool):
    raise TypeError(
        f"sync_batch_norm={sync_batch_norm!r} is of type "
        f"{type(sync_batch_norm).__name__}; pass True (the whole batch's "
        "statistics, the default) or False (each tower's own).")
  sums.validate_loss_reduction(loss_reduction)
  placement = _devices.as_variable_placement(variable_placement)
  given = None if devices is None else _devices.resolve_devices(devices)
  accepted = accepted_arguments(model_fn)
  cluster.check_tf_config()
  if cluster.trainers_only():
    _tf.lead_collectives_from_chief()
    _tf.end_on_unavailable()

  def build_spec(features: Any, labels: Any, mode: str, params: Any,
                 config: Optional[tf.estimator.RunConfig]) -> Any:
    tower_devices = given or _devices.resolve_devices(None)
    cluster.check_devices(tower_devices, config)
    arguments = _Arguments(accepted, labels is not None, mode, params, config)
    trainers = _trainers.from_config(config, mode)
    # A trainer's graph all-reduces among the trainers however it is fed.
    if _fed_by_placeholders(features) and trainers is None:
      logging.info(
          "replicate: %s graph fed by placeholders (an export): one "
          "tower, no device pinned", mode)
      return _run_on_one_device(model_fn, features, labels, arguments, None)
    if given:
      _devices.check_local_devices(given, config)
    if len(tower_devices) == 1:
      if trainers is None:
        return _run_on_one_device(model_fn, features, labels, arguments,
                                  tower_devices[0])
      # The towers' meetings are where the trainers meet: two on the one
      # device compute what it would.
      tower_devices = tower_devices * 2
    return _run_towers(model_fn, features, labels, mode, arguments,
                       tower_devices, placement or
                       _devices.default_placement(tower_devices),
                       sync_batch_norm, trainers)

  warm_start = origin.warm_starter(model_fn)

  def replicated_model_fn(
      features: Any,
      labels: Any,
      mode: str,
      params: Any = None,
      config: Optional[tf.estimator.RunConfig] = None
  ) -> tf.estimator.EstimatorSpec:
    # A TPUEstimatorSpec is converted as TPUEstimator(use_tpu=False) does.
    spec = tpu.as_estimator_spec(
        build_spec(features, labels, mode, params, config), params)
    if warm_start is not None and mode == _ModeKeys.TRAIN:
      warm_start()
    return spec

  name = getattr(model_fn, "__name__", "model_fn")
  replicated_model_fn.__name__ = f"replicated_{name}"
  replicated_model_fn.__doc__ = model_fn.__doc__
  return replicated_model_fn


class _Arguments:
  """Builds the keyword arguments of one model_fn call."""

  def __init__(self, accepted: Set[str], has_labels: bool, mode: str,
               params: Any, config: Optional[tf.estimator.RunConfig]) -> None:
    if has_labels and "labels" not in accepted:
      raise ValueError(
          "The model_fn takes no `labels` argument but the input_fn returned "
          "labels; add a `labels` argument or return features only.")
    self._accepted = accepted
    self._fixed = {"mode": mode, "params": params, "config": config}

  def for_tower(self, features: Any, labels: Any, index: int,
                num_towers: int) -> Dict[str, Any]:
    """Tower `index`'s arguments; TPUEstimator's batch size is its shard's."""
    kwargs = self(features, labels)
    if "params" in kwargs:
      kwargs["params"] = tpu.tower_params(kwargs["params"],
                                          self._fixed["config"], index,
                                          num_towers)
    return kwargs

  def __call__(self, features: Any, labels: Any) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {"features": features}
    if "labels" in self._accepted:
      kwargs["labels"] = labels
    for name, value in self._fixed.items():
      if name in self._accepted:
        # Copies, so that towers cannot leak state into each other.
        kwargs[name] = value if name == "mode" else _copied(name, value)
    return kwargs


def _copied(name: str, value: Any) -> Any:
  """A deep copy of the model_fn's `params` or `config` for one tower.

  Raises:
    TypeError: `value` cannot be deep-copied, naming it.
  """
  try:
    return copy.deepcopy(value)
  except Exception as error:  # pylint: disable=broad-except
    raise TypeError(
        f"{name} of type {type(value).__name__} ({value!r:.200}) cannot be "
        f"deep-copied ({type(error).__name__}: {error}); replicate gives each "
        f"tower a copy of the model_fn's {name}, so that no tower changes "
        f"another's: pass {name} that copy.deepcopy can copy (plain values, "
        "or objects defining __deepcopy__).") from error


def accepted_arguments(model_fn: Callable[..., Any]) -> Set[str]:
  parameters = inspect.signature(model_fn).parameters.values()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return {"features", "labels", "mode", "params", "config"}
  return {p.name for p in parameters}


def _fed_by_placeholders(features: Any, max_ops: int = 10000) -> bool:
  """Whether the features are fed through placeholders.

  That is how `export_saved_model` (and any serving graph) gets its inputs,
  and `experimental_export_all_saved_models` its TRAIN and EVAL graphs' too.
  Such a graph, in every mode, is the unwrapped model_fn's, with no device
  pinned, so that the SavedModel is the plain model's and loads on any
  machine, a CPU-only one included. (`placeholder_with_default` is not a
  feed the export makes: such graphs are replicated.)
  """
  tensors = [
      t for t in tf.nest.flatten(features, expand_composites=True)
      if isinstance(t, tf.Tensor)
  ]
  return any(
      op.type in _PLACEHOLDER_OPS
      for op in _graph.ancestors(tensors, limit=max_ops))


def _on_device(device: Optional[str]) -> ContextManager[Any]:
  """`tf.device(device)`, or nothing at all for None (not a device reset)."""
  return tf.device(device) if device else contextlib.nullcontext()


def _run_on_one_device(model_fn: Callable[..., Any], features: Any, labels: Any,
                       arguments: _Arguments, device: Optional[str]) -> Any:
  """One device (None: unpinned): no splitting, no added ops, own names."""
  graph = tf.compat.v1.get_default_graph()
  replication = _context.Replication(
      num_towers=1, fractions=[1.0], sizes=[None], graph=graph)
  with _context.replication_scope(replication):
    replication.tower = _context.Tower(0, 1, device)
    with _on_device(device):
      return model_fn(**arguments(features, labels))


_UNFOLDED_SHAPES = _tf.Patches("tf.shape and tf.size of static tensors",
                               _tf.install_unfolded_shapes)
_TOWER_ROOTS = _tf.Patches("absolute name scopes of towers",
                           _tf.install_tower_roots)


def _mirrors(placement: _devices.VariablePlacement,
             consolidation_device: str) -> bool:
  """Whether MIRRORED copies the variables: on one machine, in every mode
  (training copies the update too; evaluation and prediction read their
  own device's copies, filled when the session starts).

  On a cluster the variables stay on the parameter servers, read once per
  step by each machine (see docs/several_machines.md).
  """
  if placement is not _devices.VariablePlacement.MIRRORED:
    return False
  if cluster.on_cluster(consolidation_device):
    logging.info(
        "replicate: MIRRORED on a cluster: the variables stay where the "
        "cluster's device function puts them (%s's parameter servers)",
        consolidation_device)
    return False
  return True


def _run_towers(model_fn: Callable[..., Any],
                features: Any,
                labels: Any,
                mode: str,
                arguments: _Arguments,
                devices: Sequence[str],
                placement: _devices.VariablePlacement,
                sync_batch_norm: bool,
                trainers: Optional[_trainers.Trainers] = None) -> Any:
  """Several devices (or trainers): split, build the towers in turn, check,
  merge."""
  graph = tf.compat.v1.get_default_graph()
  consolidation_device = _devices.consolidation_device(devices)
  logging.info("replicate: %d towers on %s, variables %s, merging on %s",
               len(devices), devices, placement.value, consolidation_device)
  first_op = len(graph.get_operations())
  names_before = dict(_tf.names_in_use(graph))
  with tf.device(consolidation_device), tf.name_scope("split_inputs"):
    shards = _split.split_batch(features, labels, len(devices))
  # The consolidation device and the towers as the caller's device scope (a
  # cluster's replica_device_setter) places them: what the library builds
  # between the towers, outside every scope, goes there.
  split = graph.get_operations()[first_op:]
  consolidation_device = next((op.device for op in split if op.device),
                              consolidation_device)
  mirrored = _mirrors(placement, consolidation_device)
  replication = _context.Replication(
      num_towers=len(devices),
      fractions=shards.fractions,
      sizes=shards.sizes,
      valid=shards.valid,
      graph=graph,
      consolidation_device=consolidation_device,
      devices=list(devices),
      sync_batch_norm=sync_batch_norm,
      placed=[
          _devices.on_task_of(device, consolidation_device)
          for device in devices
      ],
      split_op_names={op.name for op in split},
      inputs=list(zip(shards.features, shards.labels)),
      mirrored=mirrored,
      trainers=trainers)
  replication.meetings = meetings.Meetings(replication)
  replication.rewiring = rewiring.Rewiring(replication)
  replication.views = views.GraphViews(graph, names_before)
  if placement is _devices.VariablePlacement.MIRRORED and cluster.on_cluster(
      consolidation_device):
    # The cluster's device function puts the variables on its ps.
    placement = _devices.VariablePlacement.SHARED
  choose = _devices.variable_device_chooser(placement, devices, mirrored)
  device_functions = [
      _devices.tower_device_function(device, choose) for device in devices
  ]
  with _context.replication_scope(replication), \
      _UNFOLDED_SHAPES.applied(), _TOWER_ROOTS.applied(), \
      per_tower.per_tower(replication), \
      lookups.routed(replication), routing.routed(replication), \
      own_gradients.routed(replication):
    specs = build.build_towers(
        replication, lambda i: model_fn(**arguments.for_tower(
            shards.features[i], shards.labels[i], i, len(devices))),
        device_functions)
    replication.meetings.check_complete()
    _specs.check_same_metrics(specs)
    replication.rewiring.finish(specs)
  if mode == _ModeKeys.TRAIN:
    _check_optimizer_calls(replication)
  try:
    state.combine_state_writes(replication, specs)
  except ValueError as error:
    for name, other_modes in _gradient_free_trainers(replication):
      raise ValueError(
          f"{name} cannot be replicated in {mode}: {other_modes}.") from error
    raise
  if mirrored:
    _mirrored.mirror(replication)
  spec = _specs.merge_specs(mode, specs, replication)
  if trainers is not None and isinstance(spec, tf.estimator.EstimatorSpec):
    _trainers.check_all_reduced(trainers, split, spec.train_op)
    spec = _trainers.started(spec, trainers)
  return spec


# Ops of estimators that train without gradients of a loss: the estimator,
# and what replicates of it in EVAL and PREDICT.
_SDCA = ("LinearClassifier/LinearRegressor with SDCAOptimizer (LinearSDCA)",
         "its EVAL and PREDICT graphs replicate")
_KMEANS = ("KMeansClustering",
           "evaluate and predict with it unwrapped too: its EVAL and PREDICT "
           "graphs build its cluster initialisation as well, a variable "
           "write inside a tf.cond that the towers cannot combine")
_GRADIENT_FREE_TRAINING = {
    "SdcaOptimizer": _SDCA,
    "SdcaOptimizerV2": _SDCA,
    "NearestNeighbors": _KMEANS,
    "KmeansPlusPlusInitialization": _KMEANS,
    "KMC2ChainInitialization": _KMEANS,
}


def _gradient_free_trainers(
    replication: _context.Replication) -> List[Tuple[str, str]]:
  return sorted({
      _GRADIENT_FREE_TRAINING[op.type]
      for op in replication.tower_ops[0]
      if op.type in _GRADIENT_FREE_TRAINING
  })


def _check_optimizer_calls(replication: _context.Replication) -> None:
  """In TRAIN with several towers an optimizer call must have met the towers.

  Checked before the towers' state writes are combined, so that a model
  that trains some other way gets this error, not one about its writes.
  """
  if replication.apply_calls:
    return
  for name, other_modes in _gradient_free_trainers(replication):
    raise ValueError(
        f"{name} trains without gradients of a loss (its own ops compute "
        "the update from the whole batch), so its TRAIN graph cannot be "
        f"replicated over {replication.num_towers} towers, with or without "
        "replicate.TowerOptimizer; train it with the unwrapped model_fn; "
        f"{other_modes}.")
  raise ValueError(
      f"The model_fn was replicated over {replication.num_towers} towers in "
      "TRAIN but made no optimizer call the towers could share: replicate "
      "routes the methods of tf.compat.v1.train.Optimizer and "
      "tf.keras.optimizers.legacy.Optimizer (minimize, compute_gradients / "
      "get_gradients, apply_gradients, get_updates) and of their subclasses, "
      "but not an optimizer whose methods are its own attributes (e.g. a "
      "mock), nor variables the model_fn updates itself. Wrap the optimizer "
      "in replicate.TowerOptimizer, which calls its `minimize` / "
      "`get_updates` once with the whole batch's loss.")
