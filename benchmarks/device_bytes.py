r"""Bytes each device sends and receives in one training step, one machine.

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
- `busiest x min`: that device's bytes over 2(N-1)/N x P, what each device
  moves in a ring all-reduce of the gradients (the bandwidth minimum for
  dense parameters);
- `transfers`: `_Send`s per step;
- `held heaviest / mean`: the variables' bytes (optimizer slots included)
  on the tower device holding most, over the mean.

Variants: `plain` (the unwrapped model_fn on CPU:1, inputs from the host),
`shared` and `round_robin` (`replicate.VariablePlacement`).

  PYTHONPATH=. python benchmarks/device_bytes.py --workloads=mlp,cnn_bn \
      --towers=2,4,8
"""

import collections
import importlib
import os
import re
import sys
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
flags.DEFINE_list("variants", ["plain", "shared", "round_robin"], "Variants.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")
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


def _build(workload: str, variant: str, num_towers: int,
           batch_size: int) -> Tuple[tf.Operation, int]:
  """The variant's train op in the default graph, and P in bytes."""
  tf.compat.v1.train.create_global_step()
  x, y = workloads.synthetic_data(batch_size, seed=0)
  with tf.device(_HOST):
    features = {"x": tf.constant(x)}
    labels = tf.constant(y)
  params = {"workload": workload, "learning_rate": 0.01, "momentum": 0.9}
  if variant == "plain":
    with tf.device("/device:CPU:1"):
      spec = workloads.model_fn(features, labels, "train", params)
  else:
    replicated = replicate.replicate_model_fn(
        workloads.model_fn,
        devices=_tower_devices(num_towers),
        variable_placement=variant)
    spec = replicated(features, labels, "train", params)
  parameters = sum(v.shape.num_elements() * v.dtype.size
                   for v in tf.compat.v1.trainable_variables())
  return spec.train_op, parameters


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


def _held(num_towers: int) -> Dict[str, float]:
  """MB of variables (slots included) per tower device, in this graph."""
  held = {_short(d): 0.0 for d in _tower_devices(num_towers)}
  for variable in tf.compat.v1.global_variables():
    device = _short(variable.device)
    if device in held:
      held[device] += variable.shape.num_elements() * variable.dtype.size / 1e6
  return held


def measure(workload: str,
            variant: str,
            num_towers: int,
            batch_size: int,
            run_step: bool = True) -> Dict[str, Any]:
  """One traced step of one variant: its transfers, summed per device."""
  with tf.Graph().as_default():
    train_op, parameters = _build(workload, variant, num_towers, batch_size)
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
      run_metadata = tf.compat.v1.RunMetadata()
      session.run(
          train_op,
          options=tf.compat.v1.RunOptions(
              trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
              output_partition_graphs=True),
          run_metadata=run_metadata)
  transfers = _transfers(run_metadata)
  moved = collections.Counter()
  host, between = 0, 0
  for sender, receiver, size in transfers:
    moved[sender] += size
    moved[receiver] += size
    if _short(_HOST) in (sender, receiver):
      host += size
    else:
      between += size
  towers = [_short(d) for d in _tower_devices(num_towers)]
  tower_bytes = [moved[d] for d in towers]
  busiest = max(tower_bytes)
  mean = sum(tower_bytes) / len(tower_bytes)
  minimum = 2 * (num_towers - 1) / num_towers * parameters  # 0 for N = 1
  return {
      "workload": workload,
      "variant": variant,
      "towers": num_towers,
      "P_MB": parameters / 1e6,
      "host_towers_MB": host / 1e6,
      "between_towers_MB": between / 1e6,
      "busiest_over_mean": busiest / mean if mean else 0.0,
      "busiest_x_min": busiest / minimum if minimum else 0.0,
      "transfers": len(transfers),
      "per_device_MB": {
          d: moved[d] / 1e6 for d in sorted(moved)
      },
      **stored,
  }


def _table(rows: List[Dict[str, Any]]) -> str:
  if "transfers" not in rows[0]:
    return "\n".join(
        f"{r['workload']} {r['variant']} N={r['towers']}: held heaviest / "
        f"mean {r['held_heaviest_over_mean']:.2f}, MB per device "
        f"{[round(v, 1) for v in r['held_MB'].values()]}" for r in rows)
  lines = [
      "| workload | variant | N | P MB | host<->towers MB | between towers MB"
      " | busiest / mean | busiest x min | transfers | held heaviest / mean |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  ]
  for r in rows:
    lines.append(f"| {r['workload']} | {r['variant']} | {r['towers']} | "
                 f"{r['P_MB']:.2f} | {r['host_towers_MB']:.2f} | "
                 f"{r['between_towers_MB']:.2f} | "
                 f"{r['busiest_over_mean']:.2f} | {r['busiest_x_min']:.2f} | "
                 f"{r['transfers']} | {r['held_heaviest_over_mean']:.2f} |")
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
    for n in towers:
      for variant in FLAGS.variants:
        if variant == "plain" and n != towers[0]:
          continue
        rows.append(
            measure(workload, variant, 1 if variant == "plain" else n,
                    FLAGS.batch_size, FLAGS.run_step))
        print(rows[-1], flush=True)
  print(_table(rows))


if __name__ == "__main__":
  app.run(main)
