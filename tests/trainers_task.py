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
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
import tensorflow as tf  # pylint: disable=g-import-not-at-top

FEATURES = 6


def model_fn(features, labels, mode, params):
  """Two dense layers, a non-fused batch norm and Adam, in float64."""
  x = features["x"]
  init = tf.compat.v1.glorot_uniform_initializer(seed=1, dtype=tf.float64)
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
  loss = tf.compat.v1.losses.mean_squared_error(labels, predictions)
  optimizer = tf.compat.v1.train.AdamOptimizer(params["learning_rate"])
  updates = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(updates):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
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


def main(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--model_dir", required=True)
  parser.add_argument("--parts", default="5,5")
  parser.add_argument("--last", default="")
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--towers", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=150)
  args = parser.parse_args(argv)
  sys.path.insert(0,
                  os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.INFO)
  import replicate  # pylint: disable=g-import-not-at-top
  from replicate import testing  # pylint: disable=g-import-not-at-top
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
  config = tf.estimator.RunConfig(
      model_dir=args.model_dir,
      save_checkpoints_steps=2,
      session_config=testing.session_config(max(args.towers, 1)))
  estimator = tf.estimator.Estimator(
      replicate.replicate_model_fn(model_fn, devices=devices),
      config=config,
      params={"learning_rate": 0.05})
  batches = global_batches(parts, last, args.steps)
  hook = _Record(os.path.join(args.out, f"{label}.npz"))
  train = tf.estimator.TrainSpec(
      input_fn_for(batches, trainer), max_steps=args.steps, hooks=[hook])
  if task:
    tf.estimator.train_and_evaluate(
        estimator, train,
        tf.estimator.EvalSpec(input_fn_for(batches, trainer), steps=1))
  else:
    estimator.train(train.input_fn, max_steps=args.steps, hooks=[hook])
  print(f"{label} done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
