r"""Op counts and build time of the workloads' training graphs, per tower count.

Builds each workload's TRAIN graph (features and labels from a dataset
iterator with the global batch's static shape) with the unwrapped model_fn and
with `replicate.replicate_model_fn(model_fn, devices=N virtual CPUs)`, and
reports the ops the model_fn added, the CPU seconds the model_fn call took
(process time, median over --repeats builds, taken in turn after one untimed
build: a build is single-threaded Python, and process time leaves out the
waits a busy machine adds, which move wall time by 2x), and whether the
1-tower replicated graph has exactly the unwrapped graph's op names and types
(replicate's promise: one tower adds no ops).

`replicate` is whichever PYTHONPATH finds first, so the same script measures
an older checkout (benchmarks/compare_versions.py runs it for both).

  PYTHONPATH=. .venv/bin/python benchmarks/graph_stats.py --towers=1,2,4
"""

import os
import statistics
import time
from typing import Any, Dict, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import common
import tensorflow as tf
import workloads

import replicate

FLAGS = flags.FLAGS
flags.DEFINE_list("workloads", ["mlp", "cnn"],
                  f"Subset of {workloads.WORKLOADS}.")
flags.DEFINE_list("towers", ["1", "2", "4"], "Tower counts N.")
flags.DEFINE_integer("batch_size", 256, "Global batch (static shape).")
flags.DEFINE_integer("repeats", 3, "Timed builds per graph.", lower_bound=1)
flags.DEFINE_string("result_file", None, "Where the JSON goes (else stdout).")

_PARAMS = {"learning_rate": 0.01, "momentum": 0.9}


def _batch():
  """Features and labels from a dataset iterator, as the Estimator feeds.

  Not placeholders: replicate builds a graph fed by placeholders (an
  export) on one tower.
  """
  x, y = workloads.synthetic_data(FLAGS.batch_size, 0)
  dataset = tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def build(workload: str, towers: Optional[int]):
  """One TRAIN graph: ({op name: type} the model_fn added, seconds).

  towers=None: the unwrapped model_fn; else replicate_model_fn on the
  first `towers` CPUs.
  """
  fn, extra = workloads.model_fn, {}
  if towers is not None:
    fn = replicate.replicate_model_fn(
        fn, devices=[f"/device:CPU:{i}" for i in range(towers)])
    # What the Estimator passes: the session's CPUs for the device check.
    extra["config"] = tf.estimator.RunConfig(
        session_config=tf.compat.v1.ConfigProto(device_count={"CPU": towers}))
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.set_random_seed(0)
    tf.compat.v1.train.get_or_create_global_step()
    features, labels = _batch()
    existing = len(graph.get_operations())
    started = time.process_time()
    fn(features, labels, tf.estimator.ModeKeys.TRAIN,
       dict(_PARAMS, workload=workload), **extra)
    seconds = time.process_time() - started
    ops = graph.get_operations()[existing:]
  return {op.name: op.type for op in ops}, seconds


def measure(workload: str, towers: list) -> Dict[str, Any]:
  """Op counts and median build seconds: unwrapped ('plain') and per N."""
  configs = [None] + towers
  build(workload, None)  # untimed: first-use costs (layer classes, kernels)
  ops, seconds = {}, {c: [] for c in configs}
  for _ in range(FLAGS.repeats):
    for c in configs:
      ops[c], s = build(workload, c)
      seconds[c].append(s)
  result = {
      "plain": {
          "ops": len(ops[None]),
          "build_s": statistics.median(seconds[None])
      }
  }
  for n in towers:
    result[str(n)] = {
        "ops": len(ops[n]),
        "build_s": statistics.median(seconds[n])
    }
  if 1 in towers:
    result["one_tower_same_ops"] = ops[1] == ops[None]
  return result


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  towers = sorted({int(n) for n in FLAGS.towers})
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(
      cpu, [tf.config.LogicalDeviceConfiguration()] * max(towers))
  result = {
      "library": os.path.dirname(os.path.abspath(replicate.__file__)),
      "workloads": {
          w: measure(w, towers) for w in FLAGS.workloads
      }
  }
  common.write_json(result, FLAGS.result_file)


if __name__ == "__main__":
  app.run(main)
