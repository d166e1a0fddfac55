"""One task of a cluster of trainers only (or one device alone), for tests.

    TF_CONFIG=... python tests/trainers_task.py --out=DIR --model_dir=DIR \\
        --parts=5,5 --steps=4 --towers=2

A float64 model (dense layers, batch-norm statistics written from
reductions, Adam: slots) trains on a fixed data set. Each step's global
batch is the trainers' parts in task order (`--parts`: rows of each
trainer, `--last`: rows of each in the last step); with `TF_CONFIG` this
task reads its own part, without it the whole global batch on one device.
At the end the task writes its losses and every global variable to
`<out>/<task>.npz`.
"""

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import tensorflow as tf

# Before tf.estimator is used: on TensorFlow 2.16+ replicate provides it.
import replicate
from replicate import testing

FEATURES = 6


class OwnDifferentiation(tf.compat.v1.train.AdamOptimizer):
  """An optimizer whose minimize differentiates by TensorFlow's internal
  gradients function, which replicate does not route."""

  def minimize(self, loss, global_step=None, var_list=None, **unused):
    # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
    from tensorflow.python.ops import gradients_impl
    variables = var_list or tf.compat.v1.trainable_variables()
    grads = gradients_impl.gradients(loss, variables)
    return self.apply_gradients(zip(grads, variables), global_step)


def _train_op(loss, route, learning_rate, tape):
  """The train_op of `loss` by the optimizer call `route` names."""
  step = tf.compat.v1.train.get_global_step()
  variables = tf.compat.v1.trainable_variables()
  v1 = tf.compat.v1.train.AdamOptimizer(learning_rate)
  keras = tf.keras.optimizers.legacy.Adam(learning_rate)
  if route in ("v1_minimize", "width_by_step"):
    return v1.minimize(loss, step)
  if route == "embedding_adagrad":
    return tf.compat.v1.train.AdagradOptimizer(learning_rate).minimize(
        loss, step)
  if route == "embedding_momentum":
    return tf.compat.v1.train.MomentumOptimizer(learning_rate,
                                                0.9).minimize(loss, step)
  if route == "embedding_adam":
    return v1.minimize(loss, step)
  if route == "own_differentiation":
    return OwnDifferentiation(learning_rate).minimize(loss, step)
  if route == "tower_optimizer":
    return replicate.TowerOptimizer(v1).minimize(loss, step)
  if route == "v1_compute_apply":
    pairs = v1.compute_gradients(loss)
    return v1.apply_gradients([(g * 0.5, v) for g, v in pairs], step)
  if route == "tf_gradients":
    grads, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), 1.0)
    return v1.apply_gradients(zip(grads, variables), step)
  if route in ("keras_get_updates", "keras_minimize", "keras_get_gradients"):
    if route == "keras_get_updates":
      updates = keras.get_updates(loss, variables)
    elif route == "keras_minimize":
      updates = [keras.minimize(loss, variables, tape=tape)]
    else:
      grads = keras.get_gradients(loss, variables)
      updates = [keras.apply_gradients(zip(grads, variables))]
    with tf.control_dependencies(updates):
      return tf.compat.v1.assign_add(step, 1).op
  raise ValueError(f"unknown route {route}")


def model_fn(features, labels, mode, params):
  """Two dense layers, a non-fused batch norm and Adam, in float64."""
  route = params["route"]
  tape = tf.GradientTape()
  taped = route in ("tape", "keras_minimize")
  with tape if taped else contextlib.nullcontext():
    x = features["x"]
    init = tf.compat.v1.glorot_uniform_initializer(seed=1, dtype=tf.float64)
    if route.startswith("embedding_"):
      # Ids from the rows: a lookup whose gradient is sparse (rows).
      ids = tf.cast(tf.floor(tf.abs(x[:, 0]) * 4.0), tf.int64) % 7
      table = tf.compat.v1.get_variable(
          "table", [7, 3], tf.float64, initializer=init)
      x = tf.concat([x, tf.nn.embedding_lookup(table, ids)], 1)
    hidden = tf.compat.v1.layers.dense(
        x, 8, activation=tf.nn.tanh, kernel_initializer=init, name="hidden")
    hidden = tf.compat.v1.layers.batch_normalization(
        hidden,
        training=mode == tf.estimator.ModeKeys.TRAIN,
        fused=False,
        name="norm")
    out = tf.compat.v1.layers.dense(
        hidden, 1, kernel_initializer=init, name="out")
    predictions = tf.squeeze(out, 1)
    if mode == tf.estimator.ModeKeys.PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions=predictions)
    if params["loss"] == "v1":
      # TensorFlow's v1 losses compute in float32, even of float64 values.
      loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
    else:
      loss = tf.reduce_mean(tf.square(labels - predictions))
    if route == "width_by_step":
      # A batch mean over the first 1 to 3 hidden units, by step: its
      # length changes from step to step (its static shape is unknown).
      width = 1 + tf.compat.v1.train.get_global_step() % 3
      means = tf.reduce_mean(hidden[:, :tf.cast(width, tf.int32)], 0)
      loss += tf.cast(0.1 * tf.reduce_sum(tf.square(means)), loss.dtype)
  updates = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(updates):
    if route == "tape":
      variables = tf.compat.v1.trainable_variables()
      optimizer = tf.compat.v1.train.AdamOptimizer(params["learning_rate"])
      train_op = optimizer.apply_gradients(
          zip(tape.gradient(loss, variables), variables),
          tf.compat.v1.train.get_global_step())
    elif route == "v1_rows_loss":
      # A loss with rows: the optimizer differentiates their sum.
      optimizer = tf.compat.v1.train.AdamOptimizer(params["learning_rate"])
      train_op = optimizer.minimize(
          tf.square(labels - predictions) / 10.0,
          tf.compat.v1.train.get_global_step())
    else:
      train_op = _train_op(loss, route, params["learning_rate"], tape)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def global_batches(parts, last, steps):
  """Per step, each trainer's rows (x, y) of the global batch."""
  rng = np.random.RandomState(0)
  batches = []
  for step in range(steps):
    sizes = last if (last and step == steps - 1) else parts
    batches.append([
        (rng.normal(size=(n, FEATURES)), rng.normal(size=(n,))) for n in sizes
    ])
  return batches


def input_fn_for(batches, trainer):
  """The input_fn of one trainer (None: the whole global batch)."""

  def rows(step_parts):
    chosen = step_parts if trainer is None else [step_parts[trainer]]
    return (np.concatenate([x for x, _ in chosen]),
            np.concatenate([y for _, y in chosen]))

  steps = [rows(p) for p in batches]
  width = max(len(y) for _, y in steps)
  xs = np.zeros((len(steps), width, FEATURES))
  ys = np.zeros((len(steps), width))
  sizes = np.array([len(y) for _, y in steps])
  for i, (x, y) in enumerate(steps):
    xs[i, :len(y)], ys[i, :len(y)] = x, y

  def input_fn():
    data = tf.data.Dataset.range(len(steps)).map(lambda s: ({
        "x": tf.gather(xs, s)[:tf.gather(sizes, s)]
    }, tf.gather(ys, s)[:tf.gather(sizes, s)]))
    return data

  return input_fn


class _Record(tf.estimator.SessionRunHook):
  """Collects the loss of every step and the variables at the end."""

  def __init__(self, path):
    self._path = path
    self._losses = []

  def after_create_session(self, session, coord):
    step = session.run(tf.compat.v1.train.get_global_step())
    print(f"session created at global step {step}", flush=True)

  def before_run(self, run_context):
    loss = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.LOSSES)[-1]
    return tf.estimator.SessionRunArgs(loss)

  def after_run(self, run_context, run_values):
    self._losses.append(run_values.results)

  def end(self, session):
    names = [v.op.name for v in tf.compat.v1.global_variables()]
    values = session.run(tf.compat.v1.global_variables())
    np.savez(
        self._path,
        losses=np.array(self._losses),
        **{
            "v:" + n: v for n, v in zip(names, values)
        })


class _Slow(tf.estimator.SessionRunHook):
  """Sleeps after every step, so that a test can act mid-run."""

  def __init__(self, secs):
    self._secs = secs

  def after_run(self, run_context, run_values):
    time.sleep(self._secs)


def main(argv):
  faulthandler.register(signal.SIGUSR1)
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--model_dir", required=True)
  parser.add_argument("--parts", default="5,5")
  parser.add_argument("--last", default="")
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--towers", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=150)
  parser.add_argument("--route", default="v1_minimize")
  parser.add_argument("--step_delay", type=float, default=0)
  parser.add_argument("--save_steps", type=int, default=2)
  parser.add_argument("--loss", default="v1", choices=["v1", "float64"])
  args = parser.parse_args(argv)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.INFO)
  parts = [int(p) for p in args.parts.split(",")]
  last = [int(p) for p in args.last.split(",")] if args.last else []
  tf_config = json.loads(os.environ.get("TF_CONFIG") or "{}")
  task = tf_config.get("task")
  if task:
    tasks = [("chief", 0)
            ] + [("worker", i)
                 for i in range(len(tf_config["cluster"].get("worker", [])))]
    trainer = tasks.index((task["type"], task["index"]))
    label = f"{task['type']}{task['index']}"
  else:
    trainer, label = None, "one_device"
  testing.virtual_cpus(max(args.towers, 1))
  devices = [f"/device:CPU:{i}" for i in range(args.towers)]
  session_config = testing.session_config(max(args.towers, 1))
  if task:
    # As Estimator's default session config of a trainer: its sessions see
    # its own task only, so one (re)created after a trainer died does not
    # wait for it; the collectives reach the others all the same.
    session_config.device_filters.append(
        f"/job:{task['type']}/task:{task['index']}")
  config = tf.estimator.RunConfig(
      model_dir=args.model_dir,
      save_checkpoints_steps=args.save_steps,
      session_config=session_config)
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(model_fn, devices=devices),
      config=config,
      params={
          "learning_rate": 0.05,
          "route": args.route,
          "loss": args.loss
      })
  batches = global_batches(parts, last, args.steps)
  hook = _Record(os.path.join(args.out, f"{label}.npz"))
  hooks = [hook] + ([_Slow(args.step_delay)] if args.step_delay else [])
  train = tf.estimator.TrainSpec(
      input_fn_for(batches, trainer), max_steps=args.steps, hooks=hooks)
  if task:
    tf.estimator.train_and_evaluate(
        estimator, train,
        tf.estimator.EvalSpec(input_fn_for(batches, trainer), steps=1))
  else:
    estimator.train(train.input_fn, max_steps=args.steps, hooks=hooks)
  print(f"{label} done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
