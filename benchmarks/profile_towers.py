r"""Where a training step's time goes: plain vs replicate (vs mirrored).

Runs worker.py with FULL_TRACE steps after its timed windows, then sums the
traced op times per category (input, split, forward, backward, gradient
sum, apply, merge, bookkeeping) and per device, and counts the
cross-device transfers (_Send ops) of the partitioned graph.

  .venv/bin/python benchmarks/profile_towers.py --towers=2,4
  .venv/bin/python benchmarks/profile_towers.py --serial   # 1 thread

`--serial` (inter_op = intra_op = 1 thread) makes the op times add up to
the step time, so per-category sums are CPU cost; without it ops overlap
and the sums exceed the step's wall time. Tracing itself adds a few
microseconds per op.
"""

import collections
import glob
import os
import statistics
import tempfile
from typing import Any, Dict, List

from absl import app
from absl import flags
import common
from tensorflow.core.framework import graph_pb2
from tensorflow.core.framework import step_stats_pb2

FLAGS = flags.FLAGS
flags.DEFINE_list(
    "variants",
    ["plain", "replicate_shared", "replicate_round_robin", "mirrored"],
    "Variants to trace.")
flags.DEFINE_string("workload", "mlp", "mlp, cnn or cnn_bn.")
flags.DEFINE_list("towers", ["2", "4"], "Tower counts.")
flags.DEFINE_integer("batch_size", 256, "Global batch.")
flags.DEFINE_integer("trace_steps", 10, "Traced steps per run.")
flags.DEFINE_integer("warmup_steps", 30, "Steps before the windows.")
flags.DEFINE_bool("serial", False, "One inter-op and one intra-op thread.")
flags.DEFINE_integer("inter_op_threads", 0, "Without --serial; 0: TF's.")
flags.DEFINE_integer("intra_op_threads", 0, "Without --serial; 0: TF's.")
flags.DEFINE_integer(
    "repeats", 3, "Runs per (variant, N), interleaved; medians over all "
    "their traced steps.")
flags.DEFINE_string("trace_dir", None, "Keep traces here (default: temp).")

CATEGORIES = ("input", "split", "forward", "backward", "grad_sum", "apply",
              "merge", "transfer", "bookkeeping")
_BOOKKEEPING = {
    "Const", "VarHandleOp", "ReadVariableOp", "Identity", "NoOp", "Switch",
    "Merge", "_Retval", "_Arg", "VarIsInitializedOp", "IdentityN", "Cast",
    "Pack", "Shape", "Fill", "ExpandDims", "Reshape", "ZerosLike", "OnesLike",
    "Size", "StopGradient", "_SOURCE"
}
_REDUCE_OPS = {"CollectiveReduce", "CollectiveReduceV2", "NcclAllReduce"}


def op_type(node) -> str:
  label = node.timeline_label
  if " = " in label:
    return label.split(" = ", 1)[1].split("(", 1)[0]
  return node.node_name


def category(name: str, op: str) -> str:
  """The category of one traced op, from its name and type."""
  if op in ("_Send", "_Recv", "_HostSend", "_HostRecv") or "MEMCPY" in op:
    return "transfer"
  if op.startswith(("Iterator", "MultiDeviceIterator", "AnonymousIterator")):
    return "input"
  if name.startswith("split_inputs/"):
    return "split"
  if (name.startswith("gradient_sum/") or op in _REDUCE_OPS or
      "allreduce" in name.lower() or "CrossDeviceOps" in name):
    return "grad_sum"
  if name.startswith("merge_towers/"):
    return "merge"
  if op.startswith(("ResourceApply", "Apply")) or op == "AssignAddVariableOp":
    return "apply"
  if op in _BOOKKEEPING or op.startswith("_Mkl") and op.endswith("Identity"):
    return "bookkeeping"
  if "gradients/" in name:
    return "backward"
  return "forward"


def summarise_step(stats) -> Dict[str, Any]:
  """Wall time, busy time per category and per device of one StepStats."""
  starts, ends = [], []
  by_category = collections.Counter()
  by_device = collections.Counter()
  ops = collections.Counter()
  for device in stats.dev_stats:
    short = device.device.rsplit("/", 1)[-1]
    for node in device.node_stats:
      start = node.all_start_micros
      end = start + node.all_end_rel_micros
      starts.append(start)
      ends.append(end)
      op = op_type(node)
      by_category[category(node.node_name, op)] += node.all_end_rel_micros
      by_device[short] += node.all_end_rel_micros
      ops[op] += 1
  return {
      "wall_us": max(ends) - min(starts),
      "category_us": by_category,
      "device_us": by_device,
      "op_counts": ops
  }


def count_sends(partition_files: List[str]) -> int:
  sends = 0
  for path in partition_files:
    graph = graph_pb2.GraphDef()
    with open(path, "rb") as f:
      graph.ParseFromString(f.read())
    sends += sum(1 for n in graph.node if n.op in ("_Send", "_HostSend"))
  return sends


def traced_run(variant: str, towers: int, trace_dir: str) -> Dict[str, Any]:
  """Runs one traced worker; its record and per-step summaries."""
  inter = 1 if FLAGS.serial else FLAGS.inter_op_threads
  intra = 1 if FLAGS.serial else FLAGS.intra_op_threads
  record = common.run_worker(
      dict(
          variant=variant,
          workload=FLAGS.workload,
          towers=towers,
          batch_size=FLAGS.batch_size,
          warmup_steps=FLAGS.warmup_steps,
          window_steps=10,
          windows=3,
          trace_steps=FLAGS.trace_steps,
          trace_dir=trace_dir,
          inter_op_threads=inter,
          intra_op_threads=intra,
          fast_exit=True),
      os.path.join(trace_dir, "result.json"),
      timeout=600)
  if "error" in record:
    raise RuntimeError(f"{variant} N={towers}: {record['error']}")
  steps = []
  for base in record["traces"]:
    stats = step_stats_pb2.StepStats()
    with open(base + ".stepstats.pb", "rb") as f:
      stats.ParseFromString(f.read())
    steps.append(summarise_step(stats))
  name = f"{FLAGS.workload}_{variant}_n{towers}"
  partitions = glob.glob(os.path.join(trace_dir, f"{name}_partition*.pb"))
  return {"record": record, "steps": steps, "sends": count_sends(partitions)}


def aggregate(variant: str, towers: int,
              runs: List[Dict[str, Any]]) -> Dict[str, Any]:
  """Medians over every traced step of every run of (variant, N)."""
  steps = [s for run in runs for s in run["steps"]]
  median = lambda key, sub: statistics.median(s[key][sub] for s in steps)
  busy = [sum(s["device_us"].values()) for s in steps]
  walls = [s["wall_us"] for s in steps]
  return {
      "variant":
          variant,
      "towers":
          towers,
      "runs":
          len(runs),
      "untraced_step_ms":
          statistics.median(1e3 * FLAGS.batch_size /
                            r["record"]["examples_per_sec"] for r in runs),
      "traced_step_ms":
          statistics.median(walls) / 1e3,
      "busy_ms":
          statistics.median(busy) / 1e3,
      "gaps_ms":
          statistics.median(w - b for w, b in zip(walls, busy)) / 1e3,
      "category_ms": {
          c: median("category_us", c) / 1e3 for c in CATEGORIES
      },
      "device_ms": {
          d: median("device_us", d) / 1e3 for d in sorted(steps[0]["device_us"])
      },
      "ops":
          sum(steps[0]["op_counts"].values()),
      "sends":
          runs[0]["sends"],
  }


def _threads() -> str:
  if FLAGS.serial:
    return "1 thread"
  name = lambda n: n or "TF's"
  return (f"inter-op threads {name(FLAGS.inter_op_threads)}, intra-op "
          f"{name(FLAGS.intra_op_threads)}")


def markdown(rows: List[Dict[str, Any]]) -> str:
  head = ("| variant | N | step ms (untraced) | step ms (traced) | op time "
          "| traced - op time | ops | sends | " + " | ".join(CATEGORIES) +
          " | op time per device |")
  lines = [
      f"Workload {FLAGS.workload}, global batch {FLAGS.batch_size}, "
      f"{_threads()}; op time "
      "summed per category, ms per step: medians over the traced steps "
      f"of {FLAGS.repeats} interleaved runs.", "", head,
      "|" + "---|" * (8 + len(CATEGORIES) + 1)
  ]
  for r in rows:
    cats = " | ".join(f"{r['category_ms'][c]:.2f}" for c in CATEGORIES)
    devices = ", ".join(f"{d} {ms:.1f}" for d, ms in r["device_ms"].items())
    lines.append(f"| {r['variant']} | {r['towers']} "
                 f"| {r['untraced_step_ms']:.2f} | {r['traced_step_ms']:.2f} "
                 f"| {r['busy_ms']:.2f} | {r['gaps_ms']:.2f} "
                 f"| {r['ops']} | {r['sends']} | {cats} | {devices} |")
  return "\n".join(lines)


def main(argv):
  del argv
  trace_dir = FLAGS.trace_dir or tempfile.mkdtemp(prefix="replicate_trace_")
  towers_list = sorted(int(n) for n in FLAGS.towers)
  runs = collections.defaultdict(list)
  for repeat in range(FLAGS.repeats):
    for towers in towers_list:
      k = repeat % len(FLAGS.variants)
      for variant in FLAGS.variants[k:] + FLAGS.variants[:k]:
        runs[variant, towers].append(traced_run(variant, towers, trace_dir))
  rows = [
      aggregate(v, n, runs[v, n]) for n in towers_list for v in FLAGS.variants
  ]
  print(markdown(rows))
  print(f"\nChrome traces (chrome://tracing, Perfetto): {trace_dir}")


if __name__ == "__main__":
  app.run(main)
