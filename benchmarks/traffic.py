r"""Cross-task bytes per training step on a localhost parameter-server cluster.

Starts one `ps` and one `worker` `tf.distribute.Server` in this process
(loopback ports), the worker with `--cpus` CPU devices, and builds each
variant's TRAIN graph as Estimator builds it on a cluster: under
`replica_device_setter` (variables on /job:ps, everything else on the
worker). One step is traced (`RunOptions(trace_level=FULL_TRACE)`); the
cross-task transfers are the `RecvTensor` entries of the step stats, logged
by the receiving task with their bytes. Reported per direction (worker->ps,
ps->worker) as bytes per step and as a multiple of the minimum:

- `mlp` (784-512-512-10, dense): one read of every variable and one gradient
  per variable per step, each the parameters' bytes;
- `embedding` (a 20000x64 table gathered by the batch's ids, then dense
  layers): what the unwrapped model_fn sends (the rows one device reads and
  their gradient, the dense variables once); `embedding_sparse` the same
  table in 4 partitions, looked up as embedding columns do
  (`safe_embedding_lookup_sparse`, each example's mean);
  `embedding_converted` the lookup given the table's value (converted),
  not the variable;
- `ema` (784-32-10 with an ExponentialMovingAverage of the weights after
  the train_op), for its values: the averages must see the updated weights;
- `lstm` (a Keras LSTM(32) over the image's 28 rows: a loop that reads its
  variables at every time step) and `bn` (a conv with Keras batch
  normalization, moving statistics written each step): dense, their
  parameters' bytes are the minimum.

With --values_dir each variant also writes its losses and variables after
the steps (`MODEL_TOWERS.npz`, towers 0 for the unwrapped model_fn), so the
caller can check them against the unwrapped model_fn's.

  PYTHONPATH=. .venv/bin/python benchmarks/traffic.py --towers=1,2,4
"""

import json
import os
import sys
from typing import Dict, List, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import common
import numpy as np
import tensorflow as tf

import replicate

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "models", ["mlp", "embedding"], "Models: mlp, embedding, embedding_sparse, "
    "embedding_converted, lstm, bn, ema (for the values); a "
    "`_ref` suffix: reference variables.")
flags.DEFINE_list("towers", ["1", "2", "4"], "Tower counts N (plain always).")
flags.DEFINE_integer("cpus", 4, "CPU devices of the worker.")
flags.DEFINE_integer("batch_size", 64, "Global batch.")
flags.DEFINE_integer("steps", 2, "Steps before the traced one.")
flags.DEFINE_string("values_dir", None,
                    "Where each variant's losses and variables go (.npz).")
flags.DEFINE_string("result_file", None, "Where the JSON goes (else stdout).")

_VOCAB, _EMBEDDING = 20000, 64
_SEED = 7


def _dense(x, units, name, seed, activation=None):
  return tf.compat.v1.layers.dense(
      x,
      units,
      activation=activation,
      name=name,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))


def _keras_logits(model: str, x):
  """A Keras LSTM over the image's rows, or a conv with Keras batch norm."""
  glorot = tf.keras.initializers.GlorotUniform
  x = tf.reshape(x, [-1, 28, 28])
  if model == "lstm":
    h = tf.keras.layers.LSTM(
        32,
        name="lstm",
        kernel_initializer=glorot(1),
        recurrent_initializer=tf.keras.initializers.Orthogonal(seed=2))(
            x)
  else:
    h = tf.keras.layers.Conv2D(
        8, 3, strides=2, name="conv", kernel_initializer=glorot(3))(
            x[..., None])
    h = tf.keras.layers.BatchNormalization(name="bn")(h, training=True)
    h = tf.keras.layers.Flatten()(h)
  return tf.keras.layers.Dense(
      10, name="logits", kernel_initializer=glorot(4))(
          h)


def _logits(model: str, features):
  if model.endswith("_ref"):
    # Reference variables (TF1's, `use_resource=False`), same names.
    with tf.compat.v1.variable_scope(
        tf.compat.v1.get_variable_scope(), use_resource=False):
      return _logits(model[:-len("_ref")], features)
  if model in ("lstm", "bn"):
    return _keras_logits(model, features["x"])
  if model == "ema":
    return _dense(
        _dense(features["x"], 32, "hidden", 1, tf.nn.relu), 10, "logits", 2)
  if model == "mlp":
    h = _dense(features["x"], 512, "hidden1", 1, tf.nn.relu)
    h = _dense(h, 512, "hidden2", 2, tf.nn.relu)
    return _dense(h, 10, "logits", 3)
  if model == "embedding_sparse":
    # As embedding columns look up: a partitioned table, a safe sparse
    # lookup averaging each example's ids.
    table = tf.compat.v1.get_variable(
        "embedding", [_VOCAB, _EMBEDDING],
        initializer=tf.compat.v1.random_normal_initializer(seed=4),
        partitioner=tf.compat.v1.fixed_size_partitioner(4))
    ids = tf.sparse.from_dense(features["ids"] + 1)  # id 0 would be dropped
    h = tf.compat.v1.nn.safe_embedding_lookup_sparse(
        table,
        tf.SparseTensor(ids.indices, ids.values - 1, ids.dense_shape),
        combiner="mean")
  else:
    table = tf.compat.v1.get_variable(
        "embedding", [_VOCAB, _EMBEDDING],
        initializer=tf.compat.v1.random_normal_initializer(seed=4))
    if model == "embedding_converted":
      # The table's value, not the variable (as the safe sparse lookup
      # converts its tables): on one device that read is on the ps too.
      table = tf.convert_to_tensor(table)
    rows = tf.nn.embedding_lookup(table, features["ids"])  # [batch, 4, 64]
    h = tf.reshape(rows, [-1, 4 * _EMBEDDING])
  h = _dense(h, 32, "hidden", 5, tf.nn.relu)
  return _dense(h, 10, "logits", 6)


def model_fn(features, labels, mode, params):
  """Softmax classifier trained with Momentum (TowerOptimizer)."""
  logits = _logits(params["model"], features)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = replicate.TowerOptimizer(
      tf.compat.v1.train.MomentumOptimizer(0.05, 0.9))
  # Batch norm's moving statistics (none elsewhere).
  with tf.control_dependencies(
      tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  if params["model"] == "ema":
    weights = tf.compat.v1.trainable_variables()
    with tf.control_dependencies([train_op]):
      train_op = tf.compat.v1.train.ExponentialMovingAverage(0.5).apply(weights)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _data(model: str, batch_size: int):
  rng = np.random.RandomState(_SEED)
  y = rng.randint(0, 10, size=batch_size).astype(np.int32)
  if not model.startswith("embedding"):
    return {"x": rng.randn(batch_size, 784).astype(np.float32)}, y
  # Distinct ids per example, so one device's rows are 4 * batch_size.
  ids = rng.choice(_VOCAB, size=(batch_size, 4), replace=False)
  return {"ids": ids.astype(np.int64)}, y


class Cluster:
  """One ps and one worker server in this process, on loopback ports."""

  def __init__(self, cpus: int):
    ps_port, worker_port = common.free_ports(2)
    self.spec = tf.train.ClusterSpec({
        "ps": [f"127.0.0.1:{ps_port}"],
        "worker": [f"127.0.0.1:{worker_port}"]
    })
    self.config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus})
    self._servers = [
        tf.distribute.Server(
            self.spec,
            job_name=job,
            task_index=0,
            config=self.config,
            start=True) for job in ("ps", "worker")
    ]
    self.target = self._servers[1].target

  def device_setter(self):
    """Estimator's device function on a cluster.

    (`_get_replica_device_setter`, which it keeps private.)
    """
    return tf.compat.v1.train.replica_device_setter(
        ps_tasks=1,
        worker_device="/job:worker/task:0",
        merge_devices=True,
        cluster=self.spec)


def _transfers(run_metadata) -> Dict[str, int]:
  """Bytes received per direction, from the step stats' RecvTensor entries."""
  received = {"worker_to_ps": 0, "ps_to_worker": 0}
  for dev_stats in run_metadata.step_stats.dev_stats:
    job = tf.DeviceSpec.from_string(dev_stats.device).job
    for node in dev_stats.node_stats:
      if node.node_name != "RecvTensor":
        continue
      size = sum(o.tensor_description.allocation_description.requested_bytes
                 for o in node.output)
      received["worker_to_ps" if job == "ps" else "ps_to_worker"] += size
  return received


def measure(cluster: Cluster,
            model: str,
            towers: Optional[int],
            batch_size: int,
            steps: int,
            values_dir: Optional[str],
            traces: int = 6) -> Dict:
  """Trains `steps` steps, traces `traces` more; bytes per direction.

  towers=None: the unwrapped model_fn; else replicate_model_fn over the
  worker's first `towers` CPUs.
  """
  tf.compat.v1.Session.reset(cluster.target)  # the ps keeps old variables
  features, labels = _data(model, batch_size)
  fn = model_fn
  if towers is not None:
    fn = replicate.replicate_model_fn(
        model_fn, devices=[f"/device:CPU:{i}" for i in range(towers)])
  with tf.Graph().as_default():
    tf.compat.v1.set_random_seed(_SEED)
    with tf.compat.v1.device(cluster.device_setter()):
      tf.compat.v1.train.get_or_create_global_step()
      with tf.device("/cpu:0"):  # as Estimator calls the input_fn
        dataset = tf.data.Dataset.from_tensors((features, labels)).repeat()
        x, y = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
      spec = fn(x, y, tf.estimator.ModeKeys.TRAIN, {"model": model})
    parameters = sum(v.shape.num_elements() * v.dtype.size
                     for v in tf.compat.v1.trainable_variables())
    variables = tf.compat.v1.global_variables()  # slots and step too
    init = [
        tf.compat.v1.global_variables_initializer(),
        tf.compat.v1.local_variables_initializer()
    ]
    # Soft placement off: every op must place where it asked to be.
    config = tf.compat.v1.ConfigProto(allow_soft_placement=False)
    with tf.compat.v1.Session(cluster.target, config=config) as session:
      session.run(init)
      losses = [
          session.run([spec.loss, spec.train_op])[0] for _ in range(steps)
      ]
      traced = []
      for _ in range(traces):
        run_metadata = tf.compat.v1.RunMetadata()
        session.run(
            spec.train_op,
            options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
            run_metadata=run_metadata)
        traced.append(_transfers(run_metadata))
      # A task's RecvTensor log sometimes misses a traced step (it comes back
      # empty); every step sends the same tensors, so take the fullest.
      result = {
          "model": model,
          "towers": towers or 0,
          "parameter_bytes": parameters,
          **{
              d: max(t[d] for t in traced) for d in traced[0]
          }, "traced": traced
      }
      if values_dir:
        np.savez(
            os.path.join(values_dir, f"{model}_{towers or 0}.npz"),
            losses=np.array(losses),
            **{v.op.name: session.run(v) for v in variables})
  return result


def run(models: List[str], towers: List[int], cpus: int, batch_size: int,
        steps: int, values_dir: Optional[str]) -> List[Dict]:
  """Every model: plain, then each tower count; ratios to the minimum."""
  cluster = Cluster(cpus)
  rows = []
  for model in models:
    plain = measure(cluster, model, None, batch_size, steps, values_dir)
    # Dense: one read and one gradient of every parameter. Sparse: what the
    # unwrapped model_fn sends.
    minimum = ({
        d: plain["parameter_bytes"] for d in ("worker_to_ps", "ps_to_worker")
    } if not model.startswith("embedding") else {
        d: plain[d] for d in ("worker_to_ps", "ps_to_worker")
    })
    for result in [plain] + [
        measure(cluster, model, n, batch_size, steps, values_dir)
        for n in towers
    ]:
      for direction, least in minimum.items():
        result[f"{direction}_ratio"] = result[direction] / least
      rows.append(result)
  return rows


def _table(rows: List[Dict]) -> str:
  lines = [
      "| model | towers | worker->ps MB | x min | ps->worker MB | x min |",
      "|---|---|---|---|---|---|"
  ]
  for r in rows:
    lines.append(
        f"| {r['model']} | {r['towers'] or 'plain'} | "
        f"{r['worker_to_ps'] / 1e6:.3f} | {r['worker_to_ps_ratio']:.2f} | "
        f"{r['ps_to_worker'] / 1e6:.3f} | {r['ps_to_worker_ratio']:.2f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  rows = run(FLAGS.models, [int(n) for n in FLAGS.towers], FLAGS.cpus,
             FLAGS.batch_size, FLAGS.steps, FLAGS.values_dir)
  if FLAGS.result_file:
    with open(FLAGS.result_file, "w") as f:
      json.dump(rows, f)
  print(_table(rows))
  sys.stdout.flush()
  # In-process servers cannot be stopped; leave without waiting for them.
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  app.run(main)
