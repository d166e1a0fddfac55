r"""Bytes each device sends and receives in one step, one machine.

Virtual CPU devices stand in for a box with GPUs: `/device:CPU:0` is the
host (the input pipeline and the consolidation device), the towers are
`/device:CPU:1..N`, and fused batch norm meets as it does between GPUs
(through the hub, not on one concatenated batch). Each variant's TRAIN graph
runs a step traced (`RunOptions(output_partition_graphs=True)`,
`FULL_TRACE`); every `_Send` of the partition graphs is one transfer, sized
from the step stats' description of the tensor it sends. Reported per
workload, variant and N:

- `P`: the trainable parameters' bytes;
- `host<->towers`: bytes between the host and the tower devices (inputs,
  and for SHARED every parameter read and every gradient);
- `between towers`: bytes between tower devices (total);
- `busiest / mean`: the tower device that sends and receives most, over
  the towers' mean;
- `sent x min`, `received x min`: the most one tower device sends to, and
  receives from, the other tower devices, over 2(N-1)/N x P, what each
  device sends and receives in a ring all-reduce of the gradients (the
  bandwidth minimum for dense parameters);
- `transfers`: `_Send`s per step, and collective all-reduces (whose own
  transfers the partition graphs do not show: MirroredStrategy's default
  on CPU devices, `CollectiveReduceV2`; each device of such a ring is
  counted as sending and receiving 2(N-1)/N of the bytes reduced);
- `held MB`: the variables' bytes (optimizer slots and mirrored copies
  included) on the tower device holding most, and `held heaviest / mean`.

Variants: `plain` (the unwrapped model_fn on CPU:1, inputs from the host),
`shared`, `round_robin` and `mirrored` (`replicate.VariablePlacement`),
and `tf.distribute.MirroredStrategy` over the same devices through the
Estimator's `train_distribute`: `strategy_default` (its default
cross-device ops, ReductionToOneDevice for CPU devices) and
`strategy_hierarchical` (`HierarchicalCopyAllReduce`).

Steps (`--modes`): training, evaluation (the metrics' updates) and
prediction; `--precisions=float32,mixed` adds training with a dynamic loss
scale.

  PYTHONPATH=. python benchmarks/device_bytes.py --workloads=mlp,cnn_bn \
      --towers=2,4,8 --modes=train,eval,predict --precisions=float32,mixed
"""

import collections
import importlib
import os
import re
import sys
import tempfile
from typing import Any, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402  # pylint: disable=g-import-not-at-top
from absl import flags  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads  # noqa: E402  # pylint: disable=g-import-not-at-top

import replicate  # noqa: E402  # isort: skip

FLAGS = flags.FLAGS
flags.DEFINE_list("workloads", ["mlp", "cnn_bn"], "Workloads (workloads.py).")
flags.DEFINE_list("towers", ["2", "4", "8"], "Tower counts N.")
flags.DEFINE_list(
    "variants", ["plain", "shared", "round_robin", "mirrored"],
    "Variants: plain, shared, round_robin, mirrored, strategy_default, "
    "strategy_hierarchical.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")
flags.DEFINE_list("modes", ["train"], "Steps measured: train, eval, predict.")
flags.DEFINE_list(
    "precisions", ["float32"],
    "float32, or mixed: training with a dynamic loss scale (v1 "
    "MixedPrecisionLossScaleOptimizer, its update in a tf.cond).")
flags.DEFINE_bool(
    "run_step", True,
    "Run a traced step; without, only the variables' bytes per "
    "device (held_MB), from the graph (e.g. for resnet50).")

_HOST = "/device:CPU:0"


def _tower_devices(num_towers: int) -> List[str]:
  return [f"/device:CPU:{i}" for i in range(1, num_towers + 1)]


def _short(device: str) -> str:
  """'/job:localhost/replica:0/task:0/device:CPU:3' -> 'CPU:3'."""
  return device.rsplit("device:", 1)[-1]


def _params(workload: str, precision: str) -> Dict[str, Any]:
  return {
      "workload": workload,
      "learning_rate": 0.01,
      "momentum": 0.9,
      "precision": precision
  }


def _step(spec: Any, mode: str) -> Any:
  """What a step of `mode` runs: the train op, the metrics' updates, or the
  predictions."""
  if mode == "train":
    return spec.train_op
  if mode == "eval":
    return [update for _, update in spec.eval_metric_ops.values()]
  return spec.predictions


def _build(workload: str,
           variant: str,
           num_towers: int,
           batch_size: int,
           mode: str = "train",
           precision: str = "float32") -> Tuple[Any, int]:
  """What the variant's step of `mode` runs in the default graph, and P in
  bytes."""
  tf.compat.v1.train.create_global_step()
  x, y = workloads.synthetic_data(batch_size, seed=0)
  with tf.device(_HOST):
    features = {"x": tf.constant(x)}
    labels = None if mode == "predict" else tf.constant(y)
  params = _params(workload, precision)
  estimator_mode = {"eval": "eval", "predict": "infer"}.get(mode, mode)
  if variant == "plain":
    with tf.device("/device:CPU:1"):
      spec = workloads.model_fn(features, labels, estimator_mode, params)
  else:
    replicated = replicate.replicate_model_fn(
        workloads.model_fn,
        devices=_tower_devices(num_towers),
        variable_placement=variant)
    spec = replicated(features, labels, estimator_mode, params)
  parameters = sum(v.shape.num_elements() * v.dtype.size
                   for v in tf.compat.v1.trainable_variables())
  return _step(spec, mode), parameters


def _output_bytes(run_metadata: Any) -> Dict[Tuple[str, int], int]:
  """(node name, output slot) -> bytes, from the step stats."""
  sizes = {}
  for device in run_metadata.step_stats.dev_stats:
    for node in device.node_stats:
      for output in node.output:
        description = output.tensor_description
        size = tf.as_dtype(description.dtype).size
        for dim in description.shape.dim:
          size *= max(dim.size, 0)
        sizes[(node.node_name, output.slot)] = size
  return sizes


def _transfers(run_metadata: Any) -> List[Tuple[str, str, int]]:
  """(sending device, receiving device, bytes) of every `_Send`."""
  sizes = _output_bytes(run_metadata)
  found = []
  for graph in run_metadata.partition_graphs:
    for node in graph.node:
      if node.op != "_Send":
        continue
      name, _, slot = node.input[0].partition(":")
      size = sizes.get((re.sub(r"^\^", "", name), int(slot or 0)), 0)
      found.append((_short(node.attr["send_device"].s.decode()),
                    _short(node.attr["recv_device"].s.decode()), size))
  return found


_COLLECTIVES = ("CollectiveReduce", "CollectiveReduceV2", "NcclAllReduce")
# All-gathers: each device receives the others' (N-1)/N of the output.
_GATHERS = ("CollectiveGather", "CollectiveGatherV2")


def _collectives(run_metadata: Any) -> List[Tuple[str, int]]:
  """(device, bytes reduced) of every collective all-reduce of the step.

  Their transfers are the collective executor's, not the graph's `_Send`s;
  a ring all-reduce of b bytes over N devices has each device send and
  receive 2(N-1)/N x b, which is what `_summary` counts for them; an
  all-gather with output b, (N-1)/N x b, counted as an all-reduce of b/2.
  """
  sizes = _output_bytes(run_metadata)
  found = []
  for graph in run_metadata.partition_graphs:
    for node in graph.node:
      size = sizes.get((node.name, 0), 0)
      if node.op in _COLLECTIVES:
        found.append((_short(node.device), size))
      elif node.op in _GATHERS:
        # As much as a ring all-reduce of half the output moves.
        found.append((_short(node.device), size // 2))
  return found


def _held(num_towers: int) -> Dict[str, float]:
  """MB of variables (slots and copies included) per tower device: every
  variable op of the default graph, by its device."""
  held = {_short(d): 0.0 for d in _tower_devices(num_towers)}
  for op in tf.compat.v1.get_default_graph().get_operations():
    if op.type not in ("VarHandleOp", "VariableV2"):
      continue
    device = _short(op.device)
    if device in held:
      shape = tf.TensorShape(op.get_attr("shape"))
      size = shape.num_elements() * tf.as_dtype(op.get_attr("dtype")).size
      held[device] += size / 1e6
  return held


def _parameter_bytes() -> int:
  """P: the bytes of the default graph's trainable variables (each once)."""
  unique = {v.name: v for v in tf.compat.v1.trainable_variables()}
  return sum(v.shape.num_elements() * v.dtype.size for v in unique.values())


class _Trace(tf.estimator.SessionRunHook):
  """Traces the second step an Estimator runs; notes P and what is held."""

  def __init__(self, num_towers: int) -> None:
    self.run_metadata = None
    self.held: Dict[str, float] = {}
    self.parameters = 0
    self._num_towers = num_towers
    self._steps = 0

  def begin(self) -> None:
    self.held = _held(self._num_towers)
    self.parameters = _parameter_bytes()

  def before_run(self, run_context: Any) -> Any:
    del run_context
    if self._steps != 1:
      return None
    return tf.estimator.SessionRunArgs(
        fetches=None,
        options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
            output_partition_graphs=True))

  def after_run(self, run_context: Any, run_values: Any) -> None:
    del run_context
    if self._steps == 1:
      self.run_metadata = run_values.run_metadata
    self._steps += 1


def _strategy_step(
    workload: str,
    variant: str,
    num_towers: int,
    batch_size: int,
    mode: str = "train",
    precision: str = "float32") -> Tuple[Any, int, Dict[str, float]]:
  """A traced step of MirroredStrategy through Estimator.train_distribute
  (eval_distribute for `mode` 'eval'): (run metadata, P in bytes, MB held
  per tower device)."""
  devices = _tower_devices(num_towers)
  cross_device_ops = (
      tf.distribute.HierarchicalCopyAllReduce()
      if variant == "strategy_hierarchical" else None)
  strategy = tf.compat.v1.distribute.MirroredStrategy(
      devices, cross_device_ops=cross_device_ops)
  data = workloads.synthetic_data(batch_size * 2, seed=0)
  trace = _Trace(num_towers)
  with tempfile.TemporaryDirectory() as model_dir:
    estimator = tf.estimator.Estimator(
        workloads.model_fn,
        model_dir=model_dir,
        params=_params(workload, precision),
        config=tf.estimator.RunConfig(
            train_distribute=strategy,
            eval_distribute=strategy,
            session_config=tf.compat.v1.ConfigProto(
                device_count={"CPU": num_towers + 1}),
            save_checkpoints_steps=None,
            save_checkpoints_secs=None,
            save_summary_steps=None,
            log_step_count_steps=None))
    if mode == "eval":
      estimator.train(
          workloads.input_fn(data, batch_size // num_towers), steps=1)
      estimator.evaluate(
          workloads.input_fn(data, batch_size // num_towers),
          steps=2,
          hooks=[trace])
    else:
      estimator.train(
          workloads.input_fn(data, batch_size // num_towers),
          steps=2,
          hooks=[trace])
  return trace.run_metadata, trace.parameters, trace.held


def measure(workload: str,
            variant: str,
            num_towers: int,
            batch_size: int,
            run_step: bool = True,
            mode: str = "train",
            precision: str = "float32") -> Dict[str, Any]:
  """One traced step of one variant: its transfers, summed per device."""
  if variant.startswith("strategy_"):
    run_metadata, parameters, held = _strategy_step(workload, variant,
                                                    num_towers, batch_size,
                                                    mode, precision)
    return dict(
        _summary(workload, variant, num_towers, parameters, held, run_metadata),
        mode=mode,
        precision=precision)
  with tf.Graph().as_default():
    train_op, parameters = _build(workload, variant, num_towers, batch_size,
                                  mode, precision)
    held = _held(num_towers)
    held_mean = sum(held.values()) / num_towers
    stored = {
        "held_MB":
            held,
        "held_heaviest_over_mean":
            max(held.values()) / held_mean if held_mean else 0.0,
    }
    if not run_step:
      return {
          "workload": workload,
          "variant": variant,
          "towers": num_towers,
          "P_MB": parameters / 1e6,
          **stored
      }
    config = tf.compat.v1.ConfigProto(device_count={"CPU": num_towers + 1})
    with tf.compat.v1.Session(config=config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(tf.compat.v1.local_variables_initializer())
      run_metadata = tf.compat.v1.RunMetadata()
      session.run(
          train_op,
          options=tf.compat.v1.RunOptions(
              trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
              output_partition_graphs=True),
          run_metadata=run_metadata)
  return dict(
      _summary(workload, variant, num_towers, parameters, held, run_metadata),
      mode=mode,
      precision=precision)


def _summary(workload: str, variant: str, num_towers: int, parameters: int,
             held: Dict[str, float], run_metadata: Any) -> Dict[str, Any]:
  """The step's transfers summed per device, against the ring minimum."""
  transfers = _transfers(run_metadata)
  sent: Dict[str, int] = collections.Counter()
  received: Dict[str, int] = collections.Counter()
  host, between = 0, 0
  for sender, receiver, size in transfers:
    sent[sender] += size
    received[receiver] += size
    if _short(_HOST) in (sender, receiver):
      host += size
    else:
      between += size
  collective = 0
  for device, size in _collectives(run_metadata):
    ring = 2 * (num_towers - 1) * size // num_towers
    sent[device] += ring
    received[device] += ring
    between += ring
    collective += ring
  towers = [_short(d) for d in _tower_devices(num_towers)]
  # Parameters and gradients: what a tower device exchanges with the others.
  peer_sent: Dict[str, int] = collections.Counter()
  peer_received: Dict[str, int] = collections.Counter()
  for sender, receiver, size in transfers:
    if sender in towers and receiver in towers:
      peer_sent[sender] += size
      peer_received[receiver] += size
  for device, size in _collectives(run_metadata):
    peer_sent[device] += 2 * (num_towers - 1) * size // num_towers
    peer_received[device] += 2 * (num_towers - 1) * size // num_towers
  tower_bytes = [sent[d] + received[d] for d in towers]
  busiest = max(tower_bytes)
  mean = sum(tower_bytes) / len(tower_bytes)
  minimum = 2 * (num_towers - 1) / num_towers * parameters  # 0 for N = 1
  held_mean = sum(held.values()) / num_towers
  return {
      "workload":
          workload,
      "variant":
          variant,
      "towers":
          num_towers,
      "P_MB":
          parameters / 1e6,
      "host_towers_MB":
          host / 1e6,
      "between_towers_MB":
          between / 1e6,
      "busiest_over_mean":
          busiest / mean if mean else 0.0,
      "sent_x_min":
          max(peer_sent[d] for d in towers) / minimum if minimum else 0.0,
      "received_x_min":
          max(peer_received[d] for d in towers) / minimum if minimum else 0.0,
      "transfers":
          len(transfers) + len(_collectives(run_metadata)),
      "collective_MB":
          collective / 1e6,
      "per_device_MB": {
          d: (sent[d] + received[d]) / 1e6
          for d in sorted(set(sent) | set(received))
      },
      "held_MB":
          held,
      "held_heaviest_over_mean":
          max(held.values()) / held_mean if held_mean else 0.0,
  }


def _table(rows: List[Dict[str, Any]]) -> str:
  if "transfers" not in rows[0]:
    return "\n".join(
        f"{r['workload']} {r['variant']} N={r['towers']}: held heaviest / "
        f"mean {r['held_heaviest_over_mean']:.2f}, MB per device "
        f"{[round(v, 1) for v in r['held_MB'].values()]}" for r in rows)
  lines = [
      "| workload | step | variant | N | P MB | host<->towers MB | between "
      "towers MB | busiest / mean | sent x min | received x min | transfers | "
      "held MB (heaviest) | held heaviest / mean |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  ]
  for r in rows:
    step = r.get("mode",
                 "train") + (" mixed" if r.get("precision") == "mixed" else "")
    lines.append(f"| {r['workload']} | {step} | {r['variant']} | "
                 f"{r['towers']} | "
                 f"{r['P_MB']:.2f} | {r['host_towers_MB']:.2f} | "
                 f"{r['between_towers_MB']:.2f} | "
                 f"{r['busiest_over_mean']:.2f} | {r['sent_x_min']:.2f} | "
                 f"{r['received_x_min']:.2f} | {r['transfers']} | "
                 f"{max(r['held_MB'].values()):.1f} | "
                 f"{r['held_heaviest_over_mean']:.2f} |")
  return "\n".join(lines)


def main(argv: List[str]) -> None:
  del argv
  towers = [int(n) for n in FLAGS.towers]
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices("CPU")[0],
      [tf.config.LogicalDeviceConfiguration()] * (max(towers) + 1))
  # Towers standing in for GPUs meet on the hub, as GPUs do (the module is
  # replicate._batch_norm before the package was laid out by stage).
  try:
    strategies = importlib.import_module("replicate._batch_norm.whole_batch")
  except ImportError:
    strategies = importlib.import_module("replicate._batch_norm")
  strategies._CONCATENATE_ON_HOST = False  # pylint: disable=protected-access
  rows = []
  for workload in FLAGS.workloads:
    for mode in FLAGS.modes:
      for precision in FLAGS.precisions:
        if precision == "mixed" and mode != "train":
          continue
        for n in towers:
          for variant in FLAGS.variants:
            if variant == "plain" and n != towers[0] or (
                mode == "predict" and variant.startswith("strategy_")):
              continue
            rows.append(
                measure(workload, variant, 1 if variant == "plain" else n,
                        FLAGS.batch_size, FLAGS.run_step, mode, precision))
            print(rows[-1], flush=True)
  print(_table(rows))


if __name__ == "__main__":
  app.run(main)
