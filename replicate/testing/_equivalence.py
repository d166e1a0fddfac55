"""`assert_replicates`: N towers give one device's results, or an error says
where not.

The model_fn is trained, evaluated and run for predictions on one device
and on N towers from the same initial checkpoint; losses, trained
variables, metrics and predictions are compared within a tolerance.
"""

import contextlib
import itertools
import os
import shutil
import tempfile
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import numpy as np
import numpy.typing as npt
import tensorflow as tf

from replicate import _core
from replicate._prepare import devices as _devices
from replicate.testing._configs import check_count
from replicate.testing._configs import cpu_names
from replicate.testing._configs import merged_session_config

_ModeKeys = tf.estimator.ModeKeys

_MODES = ("train", "eval", "predict")

_NAMES_LISTED = 5

# A checkpoint is saved when training starts (step 0) and when it ends.
_NEVER = 10**9

# `eval_steps`' default: as many as `steps` (typed Any to be that default).
_UNTIL_STEPS: Any = object()

# A summed loss on uneven shards (sizes n_i of n) is weighted to
# Σ n_i² / n² of one device's, not exactly 1/N: 0.26 for 3, 3, 2, 2.
# What TensorFlow says when a Keras optimizer instance meets a second graph.
_OPTIMIZER_REUSED = ("Cannot set `iterations`", "must be from the same graph")

Towers = Union[int, Sequence[str]]


class ReplicationMismatch(AssertionError):
  """The replicated model_fn's results differ from one device's."""


class Summary(NamedTuple):
  """What `assert_replicates` compared, when everything matched.

  Attributes:
    towers: the tower counts checked against one device.
    variables: how many checkpoint variables were compared after training.
    metrics: the eval metric names compared.
    predictions: how many predicted examples were compared.
    closest_to_tolerance: the largest |difference| / (atol + rtol ×
      |one device's value|) seen; below 1 everywhere, or it would have
      failed.
  """
  towers: List[int]
  variables: int
  metrics: List[str]
  predictions: int
  closest_to_tolerance: float


def assert_replicates(
    model_fn: Union[Callable[..., tf.estimator.EstimatorSpec],
                    tf.estimator.Estimator],
    input_fn: Callable[..., Any],
    towers: Sequence[Towers] = (1, 2, 4),
    steps: int = 3,
    loss_reduction: str = tf.compat.v1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS,
    params: Optional[Dict[str, Any]] = None,
    eval_input_fn: Optional[Callable[..., Any]] = None,
    eval_steps: Optional[int] = _UNTIL_STEPS,
    predict_input_fn: Optional[Callable[..., Any]] = None,
    max_predictions: int = 256,
    modes: Sequence[str] = _MODES,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
    model_dir: Optional[str] = None,
    variable_placement: Union[_devices.VariablePlacement,
                              str] = _devices.VariablePlacement.SHARED,
) -> Summary:
  """Checks that `model_fn` replicated over N towers gives one device's results.

  Trains the unwrapped model_fn on one device for `steps` steps, and the
  replicated one on each number of towers from the same checkpoint (the
  plain run's initial weights, optimizer slots and global step) on the same
  batches; compares the loss of every step and every variable of the final
  checkpoints (optimizer slots and global step included). Then evaluates
  and predicts with one device and with the towers from the same trained
  checkpoint, and compares every metric and every prediction in order.
  Fails on the first difference of each kind, with its name, index, both
  values and the tolerance.

      replicate.testing.assert_replicates(model_fn, input_fn, towers=(2, 4))
      replicate.testing.assert_replicates(canned_estimator, input_fn)

  The towers are virtual CPU devices of one session (no GPU needed).
  `input_fn` must give the same batches on every call (seed any shuffle),
  and the model must be deterministic (no dropout while comparing). Batch
  normalization in training is compared too: the towers use the whole
  batch's statistics (`sync_batch_norm`, the default). Values
  are close when |towers - one device| <= atol + rtol × |one device|:
  towers sum in another order, so float32 results differ in the last bits;
  raise the tolerances for long runs or optimizers such as Adam, which
  magnify tiny differences in near-zero gradients, and for wide batch-norm
  models: the gradient of a layer that feeds batch norm is a small
  difference of large sums, whose rounding shows (one step of a conv net
  at batch 256 moves its first kernel 3e-4 apart relatively, as much as
  TensorFlow's oneDNN and Eigen kernels differ on one device).

  Args:
    model_fn: an Estimator model_fn (your own, or `canned.model_fn`), or an
      Estimator, whose model_fn and params are used. A v2 canned estimator
      must be given its optimizer as a function (`TowerOptimizer(lambda:
      Adagrad(0.1))`): Keras optimizer instances build one training graph.
    input_fn: the training input_fn, returning `(features, labels)`; also
      used for eval and predict unless those have their own.
    towers: each entry a number of towers (that many virtual CPUs) or a list
      of device names.
    steps: training steps, each one batch of `input_fn`.
    loss_reduction: passed to `replicate_model_fn`, which only checks it.
    params: the model_fn's params.
    eval_input_fn: input_fn for evaluation (default `input_fn`).
    eval_steps: eval batches; default `steps`, None for all of them.
    predict_input_fn: input_fn for prediction (default `eval_input_fn`).
    max_predictions: compare at most this many predicted examples.
    modes: which of 'train', 'eval', 'predict' to check.
    rtol: relative tolerance.
    atol: absolute tolerance.
    seed: the Estimator's `tf_random_seed`.
    model_dir: where to keep the runs' checkpoints; default a temporary
      directory, removed afterwards.
    variable_placement: passed to `replicate_model_fn`.

  Returns:
    A `Summary` of what was compared.

  Raises:
    ReplicationMismatch: (an AssertionError) some result differs; its
      message is the report.
    ValueError: an argument is invalid, or `replicate_model_fn` refused the
      model_fn (its own message says why).
  """
  model_fn, params = _model_fn_and_params(model_fn, params)
  tower_devices = [_tower_devices(t) for t in towers]
  _check_modes(modes)
  check = _Check(
      model_fn=model_fn,
      params=params,
      input_fn=input_fn,
      eval_input_fn=eval_input_fn or input_fn,
      predict_input_fn=predict_input_fn or eval_input_fn or input_fn,
      steps=steps,
      eval_steps=steps if eval_steps is _UNTIL_STEPS else eval_steps,
      max_predictions=max_predictions,
      modes=tuple(modes),
      tolerance=_Tolerance(rtol, atol),
      seed=seed,
      num_cpus=_cpus_needed(tower_devices),
      wrap=lambda devices: _core.replicate_model_fn(
          model_fn,
          loss_reduction=loss_reduction,
          devices=devices,
          variable_placement=variable_placement))
  with _directory(model_dir) as directory:
    return check.run(directory, tower_devices)


class _Tolerance(NamedTuple):
  rtol: float
  atol: float

  def describe(self, expected: float) -> str:
    return f"atol {self.atol:g} + rtol {self.rtol:g} × {abs(expected):.6g}"


class _Difference(NamedTuple):
  """One value that differs: its name, the report line, a likely cause."""
  name: str
  line: str
  hint: str = ""


class _Phase(NamedTuple):
  """The outcome of comparing one mode: what differs, the worst ratio."""
  differences: List[_Difference]
  closest: float


class _Check(NamedTuple):
  """One assert_replicates call: its settings, and the runs it makes."""
  model_fn: Callable[..., Any]
  params: Optional[Dict[str, Any]]
  input_fn: Callable[..., Any]
  eval_input_fn: Callable[..., Any]
  predict_input_fn: Callable[..., Any]
  steps: int
  eval_steps: Optional[int]
  max_predictions: int
  modes: Sequence[str]
  tolerance: _Tolerance
  seed: int
  num_cpus: int
  wrap: Callable[[List[str]], Callable[..., Any]]

  def run(self, directory: str, tower_devices: List[List[str]]) -> Summary:
    plain_dir = os.path.join(directory, "one_device")
    reference = self._results(
        self.model_fn, plain_dir, start=None, trained=None)
    start = os.path.join(plain_dir, "model.ckpt-0")
    trained = tf.train.latest_checkpoint(plain_dir)
    reports, closest = [], 0.0
    for devices in tower_devices:
      tower_dir = os.path.join(directory, f"towers_{len(devices)}")
      results = self._results(self.wrap(devices), tower_dir, start, trained)
      phases = _compare(reference, results, self.tolerance, len(devices))
      closest = max([closest] + [p.closest for p in phases.values()])
      reports.extend(self._report_lines(devices, phases))
    if reports:
      raise ReplicationMismatch("\n".join([
          "The model_fn does not replicate: results on towers differ from "
          "one device's (first difference of each kind):"
      ] + reports + [
          f"Tolerance: rtol={self.tolerance.rtol:g}, "
          f"atol={self.tolerance.atol:g}; pass larger rtol/atol to "
          "assert_replicates only if the differences are float "
          "rounding."
      ]))
    return Summary(
        towers=[len(d) for d in tower_devices],
        variables=len(reference.get("variables", {})),
        metrics=sorted(reference.get("metrics", {})),
        predictions=len(reference.get("predictions", [])),
        closest_to_tolerance=closest)

  def _report_lines(self, devices: List[str],
                    phases: Dict[str, _Phase]) -> List[str]:
    lines = []
    for phase, outcome in phases.items():
      if not outcome.differences:
        continue
      first = outcome.differences[0]
      names = _unique(d.name for d in outcome.differences)
      more = len(names) - _NAMES_LISTED
      others = "" if len(names) == 1 else (
          f" In all {len(names)} differ: " + ", ".join(names[:_NAMES_LISTED]) +
          (f" and {more} more." if more > 0 else "."))
      lines.append(f"  {len(devices)} towers {devices}, {phase}: "
                   f"{first.line}.{others}{first.hint}")
    return lines

  def _config(self, model_dir: str) -> tf.estimator.RunConfig:
    config = merged_session_config(self.num_cpus, None)
    # Grappler's rewrites cost more than checking graphs take to run.
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return tf.estimator.RunConfig(
        session_config=config,
        model_dir=model_dir,
        tf_random_seed=self.seed,
        save_checkpoints_steps=_NEVER,
        save_summary_steps=None,
        log_step_count_steps=None)

  def _results(self, model_fn: Callable[..., Any], model_dir: str,
               start: Optional[str], trained: Optional[str]) -> Dict[str, Any]:
    """Trains (from `start`), evaluates and predicts (from `trained`)."""
    if start is not None and "train" in self.modes:
      _copy_checkpoint(start, model_dir)
    losses: List[float] = []
    estimator = tf.estimator.Estimator(
        _recording_losses(model_fn, losses),
        config=self._config(model_dir),
        params=self.params)
    results: Dict[str, Any] = {}
    if "train" in self.modes or start is None:
      _train(estimator, self.input_fn, self.steps)
      results["losses"] = np.array(losses)
      results["variables"] = _checkpoint_values(
          tf.train.latest_checkpoint(model_dir))
    trained = trained or tf.train.latest_checkpoint(model_dir)
    if "eval" in self.modes:
      results["metrics"] = estimator.evaluate(
          self.eval_input_fn, steps=self.eval_steps, checkpoint_path=trained)
    if "predict" in self.modes:
      results["predictions"] = _predictions(estimator, self.predict_input_fn,
                                            trained, self.max_predictions)
    return results


def _compare(expected: Dict[str, Any], actual: Dict[str, Any],
             tolerance: _Tolerance, num_towers: int) -> Dict[str, _Phase]:
  """Compares each mode's results; returns what differs, by mode."""
  where = f"{num_towers} towers"
  phases = {}
  if "losses" in actual:
    losses = _compare_values(
        _by_step(expected["losses"]),
        _by_step(actual["losses"]),
        tolerance,
        where,
        "losses",
        first_only=True)
    variables = _compare_values(expected["variables"], actual["variables"],
                                tolerance, where, "variables")
    differences = losses.differences + variables.differences
    if differences and not differences[0].hint and num_towers > 1:
      differences[0] = differences[0]._replace(hint=_tower_hint())
    phases["train"] = _Phase(differences, max(losses.closest,
                                              variables.closest))
  if "metrics" in actual:
    phases["eval"] = _compare_values(expected["metrics"], actual["metrics"],
                                     tolerance, where, "metrics")
  if "predictions" in actual:
    phases["predict"] = _compare_predictions(expected["predictions"],
                                             actual["predictions"], tolerance,
                                             where)
  return phases


def _by_step(losses: Iterable[float]) -> Dict[str, float]:
  return {f"loss at step {i + 1}": loss for i, loss in enumerate(losses)}


def _tower_hint() -> str:
  """The likely causes when towers train apart from one device."""
  return (" Every reduction over the batch is the whole batch's in every "
          "tower, so look for what differs between the model_fn's calls: "
          "Python code that depends on replicate.current_tower() or draws "
          "random values (random ops also draw per tower), or an op replicate "
          "takes to compute each row from its own row (logged once per op "
          "type: 'replicate: ... ops are taken to compute each row from the "
          "same row').")


_LABELS: Dict[str, Callable[[str], str]] = {
    "losses": lambda name: name,
    "variables": lambda name: f"variable {name!r}",
    "metrics": lambda name: f"metric {name!r}",
    "predictions": lambda name: name,
}


def _compare_values(expected: Dict[str, Any],
                    actual: Dict[str, Any],
                    tolerance: _Tolerance,
                    where: str,
                    kind: str,
                    first_only: bool = False) -> _Phase:
  """Compares two name -> value dicts, in the expected dict's order."""
  differences: List[_Difference] = []
  missing = [n for n in expected if n not in actual]
  extra = [n for n in actual if n not in expected]
  label = _LABELS[kind]
  for name in missing:
    differences.append(
        _Difference(name,
                    f"{label(name)} is missing on {where} (1 device has it)"))
  for name in extra:
    differences.append(
        _Difference(name,
                    f"{label(name)} exists on {where} but not on 1 device"))
  closest = 0.0
  for name in expected:
    if name not in actual:
      continue
    line, ratio = _first_difference(_LABELS[kind](name), expected[name],
                                    actual[name], tolerance, where)
    closest = max(closest, ratio)
    if line:
      differences.append(_Difference(name, line))
      if first_only:
        break
  return _Phase(differences, closest)


def _compare_predictions(expected: Sequence[Any], actual: Sequence[Any],
                         tolerance: _Tolerance, where: str) -> _Phase:
  if len(expected) != len(actual):
    return _Phase([
        _Difference(
            "count", f"{len(actual)} examples predicted on {where}, "
            f"{len(expected)} on 1 device")
    ], 0.0)
  differences: List[_Difference] = []
  closest = 0.0
  for index, (one, other) in enumerate(zip(expected, actual)):
    phase = _compare_values(
        _flat(one, f"prediction {index}"), _flat(other, f"prediction {index}"),
        tolerance, where, "predictions")
    closest = max(closest, phase.closest)
    differences.extend(
        _Difference(f"prediction {index}", d.line) for d in phase.differences)
  return _Phase(differences, closest)


def _flat(prediction: Any, prefix: str) -> Dict[str, Any]:
  if isinstance(prediction, dict):
    return {f"{prefix}[{k!r}]": v for k, v in sorted(prediction.items())}
  return {prefix: prediction}


def _first_difference(name: str, expected: Any, actual: Any,
                      tolerance: _Tolerance,
                      where: str) -> Tuple[Optional[str], float]:
  """(report line or None, largest |difference| / allowed) for one value."""
  expected, actual = np.asarray(expected), np.asarray(actual)
  if expected.shape != actual.shape:
    return (f"{name} has shape {list(actual.shape)} on {where}, "
            f"{list(expected.shape)} on 1 device"), 0.0
  if not _is_float(expected):
    unequal = np.argwhere(np.atleast_1d(expected != actual))
    if not unequal.size:
      return None, 0.0
    index = tuple(unequal[0]) if expected.ndim else ()
    return (f"{name}{_index(index)} is {actual[index]!r} on {where}, "
            f"{expected[index]!r} on 1 device (must be equal)"), 0.0
  expected64 = expected.astype(np.float64)
  allowed = tolerance.atol + tolerance.rtol * np.abs(expected64)
  excess = np.abs(actual.astype(np.float64) - expected64) / allowed
  excess = np.where(np.isnan(expected64) & np.isnan(actual), 0.0, excess)
  excess = np.where(np.isnan(excess), np.inf, excess)
  worst = float(np.max(excess)) if excess.size else 0.0
  bad = np.argwhere(np.atleast_1d(excess > 1))
  if not bad.size:
    return None, worst
  index = tuple(bad[0]) if expected.ndim else ()
  one, other = expected64[index], actual.astype(np.float64)[index]
  return (f"{name}{_index(index)} is {other:.7g} on {where}, {one:.7g} on 1 "
          f"device (|difference| {abs(other - one):.3g} > "
          f"{tolerance.describe(one)})"), worst


def _is_float(array: npt.NDArray[Any]) -> bool:
  return np.issubdtype(array.dtype, np.floating)


def _index(index: Tuple[Any, ...]) -> str:
  return f"[{', '.join(str(int(i)) for i in index)}]" if index else ""


def _unique(names: Iterable[str]) -> List[str]:
  return list(dict.fromkeys(names))


def _train(estimator: tf.estimator.Estimator, input_fn: Callable[..., Any],
           steps: int) -> None:
  try:
    estimator.train(input_fn, steps=steps)
  except (RuntimeError, ValueError) as e:
    if not any(m in str(e) for m in _OPTIMIZER_REUSED):
      raise
    raise ValueError(
        "The model_fn's Keras optimizer was already used in another graph "
        f"({e}); a canned estimator's optimizer must be a function for "
        "assert_replicates, e.g. optimizer=replicate.TowerOptimizer(lambda: "
        "tf.keras.optimizers.legacy.Adagrad(0.05)).") from e


def _predictions(estimator: tf.estimator.Estimator, input_fn: Callable[...,
                                                                       Any],
                 checkpoint: Optional[str], limit: int) -> List[Any]:
  predictions = estimator.predict(input_fn, checkpoint_path=checkpoint)
  try:
    return list(itertools.islice(predictions, limit))
  finally:
    predictions.close()


def _recording_losses(model_fn: Callable[..., Any],
                      losses: List[float]) -> Callable[..., Any]:
  """model_fn whose TRAIN spec also records its loss after every step."""
  accepted = _core.accepted_arguments(model_fn)

  def recording_model_fn(features: Any, labels: Any, mode: str, params: Any,
                         config: tf.estimator.RunConfig) -> Any:
    arguments = {
        "features": features,
        "labels": labels,
        "mode": mode,
        "params": params,
        "config": config
    }
    spec = model_fn(**{k: v for k, v in arguments.items() if k in accepted})
    if mode != _ModeKeys.TRAIN:
      return spec
    hook = _LossRecorder(spec.loss, losses)
    return spec._replace(training_hooks=list(spec.training_hooks) + [hook])

  return recording_model_fn


class _LossRecorder(tf.estimator.SessionRunHook):
  """Appends the loss of every training step to a list."""

  def __init__(self, loss: tf.Tensor, losses: List[float]):
    self._loss = loss
    self._losses = losses

  def before_run(self, run_context: Any) -> tf.estimator.SessionRunArgs:
    return tf.estimator.SessionRunArgs(self._loss)

  def after_run(self, run_context: Any, run_values: Any) -> None:
    self._losses.append(run_values.results)


def _checkpoint_values(checkpoint: str) -> Dict[str, npt.NDArray[Any]]:
  reader = tf.train.load_checkpoint(checkpoint)
  names = sorted(reader.get_variable_to_shape_map())
  return {name: reader.get_tensor(name) for name in names}


def _copy_checkpoint(checkpoint: str, model_dir: str) -> None:
  """Makes `checkpoint` the latest one of the empty `model_dir`."""
  tf.io.gfile.makedirs(model_dir)
  for path in tf.io.gfile.glob(checkpoint + ".*"):
    tf.io.gfile.copy(path, os.path.join(model_dir, os.path.basename(path)))
  tf.compat.v1.train.update_checkpoint_state(
      model_dir, os.path.join(model_dir, os.path.basename(checkpoint)))


def _model_fn_and_params(
    model_fn: Union[Callable[..., Any],
                    tf.estimator.Estimator], params: Optional[Dict[str, Any]]
) -> Tuple[Callable[..., Any], Optional[Dict[str, Any]]]:
  if isinstance(model_fn,
                (tf.estimator.Estimator, tf.compat.v1.estimator.Estimator)):
    return model_fn.model_fn, params if params is not None else model_fn.params
  if not callable(model_fn):
    raise TypeError(
        f"assert_replicates: model_fn={model_fn!r} is neither a model_fn nor "
        "an Estimator; pass the function you give tf.estimator.Estimator.")
  return model_fn, params


def _tower_devices(towers: Towers) -> List[str]:
  if isinstance(towers, int):
    check_count(towers)
    return cpu_names(towers)
  return _devices.resolve_devices(towers)


def _cpus_needed(tower_devices: List[List[str]]) -> int:
  """The session's CPU count: enough for the highest CPU index named."""
  specs = [tf.DeviceSpec.from_string(d) for ds in tower_devices for d in ds]
  return max([s.device_index + 1 for s in specs if s.device_type == "CPU"] +
             [1])


def _check_modes(modes: Sequence[str]) -> None:
  unknown = [m for m in modes if m not in _MODES]
  if unknown or not modes:
    raise ValueError(
        f"modes={list(modes)!r}: pass one or more of {list(_MODES)}.")


@contextlib.contextmanager
def _directory(model_dir: Optional[str]) -> Iterator[str]:
  if model_dir is not None:
    yield model_dir
    return
  directory = tempfile.mkdtemp(prefix="replicate_check_")
  try:
    yield directory
  finally:
    shutil.rmtree(directory, ignore_errors=True)
