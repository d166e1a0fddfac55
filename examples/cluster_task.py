"""One task of the digits cluster: what `cluster.py --task` runs.

The task is the one `TF_CONFIG` names (ps, chief, worker or evaluator);
Estimator's `train_and_evaluate` does the rest: a ps serves its variables,
the trainers train (each replicating the model_fn over its own devices), the
evaluator evaluates each new checkpoint. Without `TF_CONFIG` the task is the
whole job on this machine. No flags here: `cluster.py` parses them, and tests
import this module.
"""

import dataclasses
import functools
import os
import threading
import time
from typing import Dict, Optional, Tuple

import digits_lib
import numpy as np
import tensorflow as tf

import replicate

CPU_TOWERS = 2
_POLL_SECS = 0.2


@dataclasses.dataclass
class TaskOptions:
  """What a task needs from the command line (see cluster.py's flags)."""
  model_dir: str
  towers: Optional[int] = None
  steps: int = 1000
  batch_size: int = 64
  model: str = "mlp"
  learning_rate: float = 0.01
  optimizer: str = "adam"
  dropout: float = digits_lib.DROPOUT
  sync: bool = False
  save_checkpoints_steps: int = 100
  throttle_secs: int = 1
  log_every: int = 100
  step_delay_ms: int = 0
  timeout: float = 600


def cluster_model_fn(features, labels, mode, params, config):
  """digits_lib's model_fn, with SyncReplicasOptimizer when params['sync'].

  The synchronous variant is an ordinary model_fn for SyncReplicasOptimizer:
  it goes inside `TowerOptimizer`, so each trainer contributes one gradient
  per step (its towers' sum), and its hook is made the usual way.
  """
  if mode != tf.estimator.ModeKeys.TRAIN or not params["sync"]:
    return digits_lib.model_fn(features, labels, mode, params)
  logits = digits_lib.build_logits(features["image"], params["model"], True,
                                   params["dropout"])
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  sync = tf.compat.v1.train.SyncReplicasOptimizer(
      digits_lib.make_optimizer(params),
      replicas_to_aggregate=config.num_worker_replicas,
      total_num_replicas=config.num_worker_replicas)
  train_op = replicate.TowerOptimizer(sync).minimize(
      loss, global_step=tf.compat.v1.train.get_global_step())
  # No initial tokens: the first update waits for every trainer's gradient,
  # so each step averages exactly one batch of each trainer.
  hook = sync.make_session_run_hook(config.is_chief, num_tokens=0)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, training_hooks=[hook])


def variables_fingerprint(values: Dict[str, np.ndarray]) -> float:
  """Sum of |value| over every variable, in float64: equal values, equal sum."""
  return float(
      sum(
          np.sum(np.abs(np.asarray(values[name], np.float64)))
          for name in sorted(values)))


class TaskProgressHook(tf.estimator.SessionRunHook):
  """Prints a trainer's progress; optionally slows it down.

  On every new session (the first, and each one after a failure) it prints
  the global step and a fingerprint of every variable, so a restore from a
  checkpoint shows; every `every` of its own steps the global step and the
  loss; at the end how fast the global step advanced while it trained.
  """

  def __init__(self, loss: tf.Tensor, every: int, delay_secs: float):
    self._loss = loss
    self._every = max(1, every)
    self._delay_secs = delay_secs
    self._steps = 0
    self._first: Optional[Tuple[int, float]] = None
    self._last: Optional[Tuple[int, float]] = None

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()
    self._variables = {v.op.name: v for v in tf.compat.v1.global_variables()}

  def after_create_session(self, session, coord):
    del coord  # Unused.
    values = session.run(self._variables)
    print(
        f"session created at global step "
        f"{values[self._global_step.op.name]}, variables fingerprint "
        f"{variables_fingerprint(values)!r}",
        flush=True)

  def before_run(self, run_context):
    return tf.estimator.SessionRunArgs((self._loss, self._global_step))

  def after_run(self, run_context, run_values):
    loss, step = run_values.results
    self._last = (int(step), time.perf_counter())
    self._first = self._first or self._last
    self._steps += 1
    if self._steps == 1 or self._steps % self._every == 0:
      print(f"global step {step:5d}  loss {loss:.4f}", flush=True)
    if self._delay_secs:
      time.sleep(self._delay_secs)

  def end(self, session):
    del session  # Unused.
    if self._first is None or self._last[1] <= self._first[1]:
      return
    rate = (self._last[0] - self._first[0]) / (self._last[1] - self._first[1])
    print(
        f"trained {self._steps} steps here; global step {self._first[0]} to "
        f"{self._last[0]}: {rate:.1f} global steps/s",
        flush=True)


class WaitForCheckpointHook(tf.estimator.SessionRunHook):
  """A worker's session waits for the chief's first checkpoint.

  A worker whose session starts before the chief has initialised the
  variables checks again only every 30 s (TensorFlow's SessionManager;
  Estimator does not expose the interval). The chief saves a checkpoint
  right after initialising them, so waiting for one here, after the graph
  is built and before the session is created, avoids that wait.
  """

  def __init__(self, model_dir: str, timeout_secs: float):
    self._model_dir = model_dir
    self._timeout_secs = timeout_secs

  def begin(self):
    deadline = time.monotonic() + self._timeout_secs
    while tf.train.latest_checkpoint(self._model_dir) is None:
      if time.monotonic() > deadline:
        raise TimeoutError(f"no checkpoint in {self._model_dir} after "
                           f"{self._timeout_secs:.0f} s: is the chief running?")
      time.sleep(_POLL_SECS)


class CancelQueueRunnersAtEndHook(tf.estimator.SessionRunHook):
  """Ends SyncReplicasOptimizer's chief queue runner as soon as training ends.

  That queue runner waits for every trainer's next gradient, which never
  comes after the last step, and MonitoredSession (so Estimator.train)
  gives its threads `stop_grace_period_secs` = 120 s to stop, which
  Estimator does not let one change. At the end this hook asks the
  session's coordinator to stop (so the queue runner's thread ends without
  an error) and closes the session, which cancels the step that thread
  waits in. Every other hook's `end` (the final checkpoint's included) must
  have run by then: put it last in `training_hooks`, whose `end`s Estimator
  calls after its own hooks' and the chief hooks'.
  """

  def after_create_session(self, session, coord):
    del session  # Unused.
    self._coord = coord

  def end(self, session):
    self._coord.request_stop()
    session.close()


class EvalReportHook(tf.estimator.SessionRunHook):
  """Prints the evaluated checkpoint's global step and metrics."""

  def __init__(self, metrics: Dict[str, tf.Tensor]):
    self._metrics = metrics

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()

  def end(self, session):
    step, metrics = session.run((self._global_step, self._metrics))
    text = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
    print(f"evaluated global step {step}: {text}", flush=True)


def with_task_hooks(model_fn, options: TaskOptions):
  """Adds the task's hooks to the merged spec (outside replicate_model_fn)."""

  def model_fn_with_hooks(features, labels, mode, params, config):
    spec = model_fn(features, labels, mode, params, config)
    if mode == tf.estimator.ModeKeys.TRAIN:
      hooks = list(spec.training_hooks) + [
          TaskProgressHook(spec.loss, options.log_every,
                           options.step_delay_ms / 1000)
      ]
      if in_cluster(config) and config.task_type == "worker" and (
          "ps" in config.cluster_spec.jobs):
        # Trainers only wait for one another in the chief's broadcast at
        # session start, which the chief's first checkpoint follows.
        hooks.append(WaitForCheckpointHook(options.model_dir, options.timeout))
      if options.sync and config.is_chief:
        hooks.append(CancelQueueRunnersAtEndHook())
      spec = tf.estimator.EstimatorSpec(
          **dict(spec._asdict(), training_hooks=hooks))
    elif mode == tf.estimator.ModeKeys.EVAL:
      metrics = {k: v for k, (v, _) in spec.eval_metric_ops.items()}
      hooks = list(spec.evaluation_hooks) + [EvalReportHook(metrics)]
      spec = tf.estimator.EstimatorSpec(
          **dict(spec._asdict(), evaluation_hooks=hooks))
    return spec

  return model_fn_with_hooks


def exit_after(timeout_secs: float) -> None:
  """Ends this process after `timeout_secs`, whatever it is doing."""

  def expire():
    print(
        f"timeout: still running after {timeout_secs:.0f} s, exiting",
        flush=True)
    os._exit(124)  # pylint: disable=protected-access

  timer = threading.Timer(timeout_secs, expire)
  timer.daemon = True
  timer.start()


def in_cluster(config: tf.estimator.RunConfig) -> bool:
  return bool(config.cluster_spec.jobs)


def trainer_index(config: tf.estimator.RunConfig) -> int:
  """The chief (or a lone machine) is trainer 0, worker i trainer i + 1."""
  if not in_cluster(config) or config.task_type != "worker":
    return 0
  return config.task_id + 1


def _devices(towers: Optional[int]):
  if towers is None and not tf.config.list_physical_devices("GPU"):
    towers = CPU_TOWERS
  return digits_lib.configure_devices(towers)


def _run_config(options: TaskOptions, session_config):
  config = tf.estimator.RunConfig(
      model_dir=options.model_dir,
      tf_random_seed=0,
      save_checkpoints_steps=options.save_checkpoints_steps,
      save_summary_steps=options.save_checkpoints_steps,
      log_step_count_steps=None,
      experimental_max_worker_delay_secs=0)
  if in_cluster(config) and config.task_type != "evaluator":
    # A trainer (or ps) of a cluster keeps Estimator's session config: device
    # filters (a trainer talks to the ps tasks and itself only) and soft
    # placement. Its towers' devices are its server's. Trainers only reach
    # one another by their collectives all the same, and a session
    # recreated after a trainer died does not wait for it.
    return config
  return config.replace(session_config=session_config)


def run_task(options: TaskOptions) -> None:
  """Runs the task TF_CONFIG names (or everything, without TF_CONFIG)."""
  exit_after(options.timeout)
  devices, session_config = _devices(options.towers)
  # Wrapped before RunConfig reads TF_CONFIG: replicate checks it first, with
  # errors that name the fix.
  model_fn = with_task_hooks(
      replicate.replicate_model_fn(cluster_model_fn, devices=devices), options)
  config = _run_config(options, session_config)
  # Without a cluster RunConfig calls the lone machine a worker.
  role = config.task_type if in_cluster(config) else "local"
  print(
      f"{role} {config.task_id}: replicate {replicate.__version__}, "
      f"towers {devices or 'every GPU'}, model_dir {options.model_dir}",
      flush=True)

  (train_x, train_y), (test_x, test_y) = digits_lib.load_digits()
  estimator = tf.estimator.Estimator(
      model_fn,
      config=config,
      params={
          "model": options.model,
          "learning_rate": options.learning_rate,
          "optimizer": options.optimizer,
          "dropout": options.dropout,
          "sync": options.sync
      })
  trainers, index = config.num_worker_replicas, trainer_index(config)
  train_spec = tf.estimator.TrainSpec(
      lambda: digits_lib.train_input_fn(train_x, train_y, options.batch_size,
                                        trainers, index),
      max_steps=options.steps)
  eval_spec = tf.estimator.EvalSpec(
      lambda: digits_lib.eval_input_fn(test_x, test_y, options.batch_size),
      steps=None,
      start_delay_secs=0,
      throttle_secs=options.throttle_secs)
  train_and_evaluate(estimator, train_spec, eval_spec)
  if role in ("chief", "local"):
    _predict(estimator, test_x, test_y, options)
  print(f"{role} done", flush=True)


# How many times a trainer starts training again after a peer task restarted.
_RESTARTED_PEER_RETRIES = 3


def train_and_evaluate(estimator: tf.estimator.Estimator,
                       train_spec: tf.estimator.TrainSpec,
                       eval_spec: tf.estimator.EvalSpec) -> None:
  """`tf.estimator.train_and_evaluate`; trains on after a peer task restarted.

  A ps that restarts fails the step in flight. TensorFlow's MonitoredSession
  makes a new session when that surfaces as AbortedError ("Session handle is
  not found ... just restarted"), but the runtime may report a receive it
  cancelled first, as a CancelledError carrying the same message, which
  ends the process (which error comes first is a race). A cluster manager
  would restart the process; this trains again in it, from the latest
  checkpoint, with `Estimator.train`: what `train_and_evaluate` runs on a
  trainer once it has started the task's server. That server keeps serving
  (TensorFlow cannot stop a gRPC server); a second one on its port would
  not start.
  """
  train = functools.partial(tf.estimator.train_and_evaluate, estimator,
                            train_spec, eval_spec)
  for attempt in range(_RESTARTED_PEER_RETRIES + 1):
    try:
      train()
      return
    except tf.errors.CancelledError as error:
      if "just restarted" not in str(error) or (attempt
                                                == _RESTARTED_PEER_RETRIES):
        raise
      print(
          "a peer task restarted during a step; training again from the "
          "latest checkpoint",
          flush=True)
      train = functools.partial(
          estimator.train,
          train_spec.input_fn,
          hooks=train_spec.hooks,
          max_steps=train_spec.max_steps)


def _predict(estimator, test_x, test_y, options: TaskOptions) -> None:
  """Predicts the test images; saves their probabilities in model_dir."""
  probabilities = np.array([
      p["probabilities"] for p in estimator.predict(
          lambda: digits_lib.eval_input_fn(test_x, None, options.batch_size))
  ])
  np.save(
      os.path.join(options.model_dir, "test_probabilities.npy"), probabilities)
  classes = np.argmax(probabilities, axis=1)
  print(
      f"test accuracy of the final checkpoint: "
      f"{np.mean(classes == test_y):.4f}; first 10 predictions "
      f"{classes[:10].tolist()}, labels {test_y[:10].tolist()}",
      flush=True)
