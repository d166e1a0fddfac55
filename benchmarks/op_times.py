r"""Time per op type of one training step: plain vs synchronised vs not.

Builds a workload's train graph in a session (constant inputs, no input
pipeline, no hooks: what the towers themselves cost), times steps, then
traces a few and sums each op type's time over every device. Where the
summed op time falls but the step does not, work left the towers'
parallel paths for the hub's serial one (benchmarks/history.md, fifth
pass).

  .venv/bin/python benchmarks/op_times.py --workload=cnn_bn --towers=2,4
"""

import collections
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
import workloads

import replicate

FLAGS = flags.FLAGS
flags.DEFINE_string("workload", "cnn_bn", "mlp, cnn or cnn_bn.")
flags.DEFINE_list("towers", ["2"], "Tower counts for the replicated variants.")
flags.DEFINE_list(
    "variants", ["plain", "sync", "unsync"],
    "plain: the model_fn unwrapped; sync / unsync: replicated "
    "with sync_batch_norm on / off.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")
flags.DEFINE_integer("steps", 50, "Timed steps, after as many warm-up steps.")
flags.DEFINE_integer("trace_steps", 5, "Traced steps the op times average.")
flags.DEFINE_integer("top", 12, "Op types listed per variant.")


def _train_op(variant: str, towers: int):
  rng = np.random.RandomState(0)
  features = {
      "x":
          tf.constant(
              rng.randn(FLAGS.batch_size,
                        workloads.NUM_INPUTS).astype(np.float32))
  }
  labels = tf.constant(
      rng.randint(0, workloads.NUM_CLASSES, FLAGS.batch_size).astype(np.int32))
  tf.compat.v1.train.create_global_step()
  model_fn = workloads.model_fn
  if variant != "plain":
    model_fn = replicate.replicate_model_fn(
        model_fn,
        devices=[f"/device:CPU:{i}" for i in range(towers)],
        sync_batch_norm=variant == "sync")
  params = dict(workload=FLAGS.workload, learning_rate=0.01, momentum=0.9)
  return model_fn(features, labels, tf.estimator.ModeKeys.TRAIN,
                  params).train_op


def _measure(variant: str, towers: int):
  """(step seconds, {op type: traced microseconds per step})."""
  with tf.Graph().as_default():
    train_op = _train_op(variant, towers)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": towers})
    with tf.compat.v1.Session(config=config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for _ in range(FLAGS.steps):
        session.run(train_op)
      start = time.perf_counter()
      for _ in range(FLAGS.steps):
        session.run(train_op)
      step = (time.perf_counter() - start) / FLAGS.steps
      micros = collections.Counter()
      for _ in range(FLAGS.trace_steps):
        metadata = tf.compat.v1.RunMetadata()
        session.run(
            train_op,
            options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
            run_metadata=metadata)
        for device in metadata.step_stats.dev_stats:
          for node in device.node_stats:
            label = node.timeline_label
            op_type = (
                label.split(" = ")[1].split("(")[0]
                if " = " in label else node.node_name)
            micros[op_type] += node.all_end_rel_micros / FLAGS.trace_steps
  return step, micros


def main(argv):
  del argv  # unused
  tf.compat.v1.disable_eager_execution()
  runs = [(variant, 1 if variant == "plain" else int(n))
          for n in FLAGS.towers
          for variant in FLAGS.variants]
  for variant, towers in dict.fromkeys(runs):
    step, micros = _measure(variant, towers)
    print(f"{FLAGS.workload} {variant} N={towers}: step {step * 1e3:.2f} ms, "
          f"traced op time {sum(micros.values()) / 1e3:.2f} ms")
    for op_type, us in micros.most_common(FLAGS.top):
      print(f"  {op_type:36s} {us / 1e3:7.2f} ms")


if __name__ == "__main__":
  app.run(main)
