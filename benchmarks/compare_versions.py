r"""Before/after: the same benchmark scripts against two checkouts' library.

Every round runs, per (workload, N) and per checkout (order rotated from
round to round), one worker process with `replicate` imported from that
checkout (PYTHONPATH first; each record says which library ran) in which
`plain` and `replicate_shared` take turns window by window. Reported:

  after/before   replicate_shared's ex/s after / before, same round
                 (separate processes seconds apart: machine drift shows)
  plain a/b      the same for plain, whose graph does not depend on the
                 library: the noise floor of after/before
  × plain        replicate_shared / plain, windows taken in turn in one
                 process (per checkout)
  rel. × plain   × plain after / × plain before, same round: the figure
                 that cancels drift between the two processes
  build s        replicate_shared's train() call to the end of its first
                 step, median over rounds

then graph_stats.py (op counts and model_fn build time of the TRAIN graph,
one tower's op names vs the unwrapped model_fn's) for each checkout, in
turn for --graph_rounds rounds.

  git worktree add --detach /tmp/before 508863f
  .venv/bin/python benchmarks/compare_versions.py --before=/tmp/before
"""

import json
import os
import statistics
import tempfile
from typing import Any, Dict, List

from absl import app
from absl import flags
from absl import logging
import common
import report

FLAGS = flags.FLAGS
flags.DEFINE_string("before", None, "Checkout whose library is 'before'.")
flags.DEFINE_string("after", common.ROOT, "Checkout whose library is 'after'.")
flags.DEFINE_list("workloads", ["mlp", "cnn"], "Workloads.")
flags.DEFINE_list("towers", ["1", "2", "4"], "Tower counts N.")
flags.DEFINE_integer("rounds", 3, "Rounds of throughput runs (0: none).")
flags.DEFINE_integer("graph_rounds", 2, "graph_stats.py runs per checkout.")
flags.DEFINE_integer("run_timeout", 600, "Seconds before a run is killed.")
common.define_timing_flags()
flags.DEFINE_string("out", None, "Write every record as JSON.")
flags.mark_flag_as_required("before")

VARIANTS = ("plain", "replicate_shared")
GRAPH_STATS = os.path.join(common.HERE, "graph_stats.py")


def _checkouts() -> Dict[str, str]:
  return {
      "before": os.path.abspath(FLAGS.before),
      "after": os.path.abspath(FLAGS.after)
  }


def _run(version: str,
         root: str,
         flags_: Dict[str, Any],
         scratch: str,
         script: str = common.WORKER) -> Dict[str, Any]:
  """One process against `root`'s library; refuses another library."""
  result = common.run_worker(
      flags_,
      os.path.join(scratch, "result.json"),
      FLAGS.run_timeout,
      library_root=root,
      script=script)
  if "error" in result:
    raise RuntimeError(f"{version}: {result['error']}")
  for record in result.get("records", [result]):
    if not record["library"].startswith(root):
      raise RuntimeError(f"{version} ran {record['library']}, not {root}.")
  return result


def throughput(scratch: str) -> List[Dict[str, Any]]:
  """Every round's records, tagged with 'version' and variant@version."""
  records = []
  timing = {
      k: FLAGS[k].value for k in ("batch_size", "examples", "warmup_steps",
                                  "window_steps", "windows")
  }
  for r in range(FLAGS.rounds):
    for workload in FLAGS.workloads:
      for n in sorted(int(t) for t in FLAGS.towers):
        versions = list(_checkouts().items())
        for version, root in versions[(r + n) % 2:] + versions[:(r + n) % 2]:
          flags_ = dict(
              workload=workload,
              towers=n,
              device_type="CPU",
              fast_exit=True,
              together=",".join(VARIANTS[r % 2:] + VARIANTS[:r % 2]),
              **timing)
          for record in _run(version, root, flags_, scratch)["records"]:
            records.append(
                dict(
                    record,
                    round=r,
                    version=version,
                    variant=f"{record['variant']}@{version}"))
          logging.info("round %d %s N=%d %s done", r, workload, n, version)
  return records


def _fmt(spread) -> str:
  return "–" if not spread else (f"{spread['median']:.2f} "
                                 f"({spread['min']:.2f}–{spread['max']:.2f})")


def _round_ratios(group, variant: str, against: str) -> List[float]:
  """Per round: median ex/s of `variant` / `against` (separate processes)."""
  by_round = {}
  for rec in group:
    by_round.setdefault(rec["round"], {})[rec["variant"]] = rec
  return [
      runs[variant]["examples_per_sec"] / runs[against]["examples_per_sec"]
      for runs in by_round.values()
      if variant in runs and against in runs
  ]


def _rel_vs_plain(group) -> List[float]:
  """Per round: (replicate/plain windows) after over the same before."""
  per_round = {}
  for version in ("before", "after"):
    by_round = {}
    for rec in group:
      if rec["version"] == version:
        by_round.setdefault(rec["round"], {})[rec["variant"]] = rec
    for r, runs in by_round.items():
      mine = runs[f"replicate_shared@{version}"]["window_examples_per_sec"]
      plain = runs[f"plain@{version}"]["window_examples_per_sec"]
      per_round.setdefault(r, {})[version] = statistics.median(
          a / b for a, b in zip(mine, plain))
  return [v["after"] / v["before"] for v in per_round.values() if len(v) == 2]


def throughput_table(records: List[Dict[str, Any]]) -> str:
  """Markdown: after/before per (workload, N), with spreads."""
  lines = [
      "| workload | N | ex/s before | ex/s after | after/before "
      "| plain a/b | × plain before | × plain after | rel. × plain "
      "| build s before | build s after |",
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  ]
  for workload in FLAGS.workloads:
    for n in sorted(int(t) for t in FLAGS.towers):
      group = [
          r for r in records if r["workload"] == workload and r["towers"] == n
      ]

      def med(key, variant, group=group):
        return statistics.median(
            r[key] for r in group if r["variant"] == variant)

      def ratio(a, b, group=group):
        return report.spread(_round_ratios(group, a, b))

      cells = [
          f"{med('examples_per_sec', 'replicate_shared@before'):,.0f}",
          f"{med('examples_per_sec', 'replicate_shared@after'):,.0f}",
          _fmt(ratio("replicate_shared@after", "replicate_shared@before")),
          _fmt(ratio("plain@after", "plain@before")),
          _fmt(_spread_of_windows(group, "before")),
          _fmt(_spread_of_windows(group, "after")),
          _fmt(report.spread(_rel_vs_plain(group))),
          f"{med('build_s', 'replicate_shared@before'):.2f}",
          f"{med('build_s', 'replicate_shared@after'):.2f}"
      ]
      lines.append(f"| {workload} | {n} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _spread_of_windows(group, version: str):
  """replicate_shared / plain over windows taken in turn, all rounds."""
  mine = [r for r in group if r["version"] == version]
  return report.spread(
      report.ratios(mine, f"replicate_shared@{version}", f"plain@{version}"))


def graph_stats(scratch: str) -> Dict[str, List[Dict[str, Any]]]:
  """graph_stats.py per checkout, in turn, --graph_rounds times."""
  found = {"before": [], "after": []}
  for _ in range(FLAGS.graph_rounds):
    for version, root in _checkouts().items():
      found[version].append(
          _run(
              version, root,
              dict(
                  workloads=",".join(FLAGS.workloads),
                  towers=",".join(FLAGS.towers),
                  batch_size=FLAGS.batch_size), scratch, GRAPH_STATS))
  return found


def graph_table(found: Dict[str, List[Dict[str, Any]]]) -> str:
  """Markdown: ops and model_fn build seconds (median over runs)."""
  lines = [
      "| workload | graph | ops before | ops after | model_fn s before "
      "| model_fn s after |", "|---|---|---:|---:|---:|---:|"
  ]
  for workload in FLAGS.workloads:
    for key in ["plain"] + [str(int(t)) for t in sorted(FLAGS.towers, key=int)]:
      cells = []
      for field, spec in (("ops", "d"), ("build_s", ".2f")):
        for version in ("before", "after"):
          values = [
              run["workloads"][workload][key][field] for run in found[version]
          ]
          cells.append(
              format(statistics.median(values), spec) if field ==
              "build_s" else str(values[0]))
      label = "unwrapped" if key == "plain" else f"{key} tower(s)"
      lines.append(f"| {workload} | {label} | " + " | ".join(cells) + " |")
  same = {
      v:
          all(run["workloads"][w].get("one_tower_same_ops")
              for run in runs
              for w in FLAGS.workloads) for v, runs in found.items()
  }
  lines.append(f"\nOne tower = the unwrapped graph's op names and types: "
               f"before {same['before']}, after {same['after']}.")
  return "\n".join(lines)


def main(argv):
  del argv
  out = {"checkouts": _checkouts()}
  with tempfile.TemporaryDirectory(prefix="replicate_versions_") as scratch:
    if FLAGS.rounds:
      out["runs"] = throughput(scratch)
      print(throughput_table(out["runs"]) + "\n")
    if FLAGS.graph_rounds:
      out["graphs"] = graph_stats(scratch)
      print(graph_table(out["graphs"]))
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
