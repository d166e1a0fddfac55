"""Loads SavedModels with the TF1 loader on one CPU, in a fresh process.

The test process splits its CPU into 4 devices (tests/conftest.py), where a
graph pinned to '/device:CPU:3' would load. This script runs without any
split, without soft placement and with no GPU, as a one-CPU serving machine
does, loads each meta graph (train, eval, serve) of each export directory,
runs its signatures on the given rows and prints what it finds as JSON,
for tests/test_export_modes.py.

    python -m tests.export_loader '{"name": "export_dir", ...}' rows.npz
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from google.protobuf import json_format  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

TAGS = {"train": ["train"], "eval": ["eval"], "serve": ["serve"]}
# Signatures whose outputs change nothing: run on the rows and compared.
RUN = {"eval": "eval", "serve": "serving_default"}


def _load(export_dir, tags, name, rows):
  """Devices, signatures and (for `name`) the outputs on `rows`."""
  config = tf.compat.v1.ConfigProto(
      allow_soft_placement=False, device_count={"GPU": 0})
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.Session(config=config) as session:
      try:
        meta_graph = tf.compat.v1.saved_model.loader.load(
            session, tags, export_dir)
      except tf.errors.OpError as e:
        return {"error": f"{type(e).__name__}: {e.message[:300]}"}
      signatures = {
          k: json_format.MessageToDict(v)
          for k, v in meta_graph.signature_def.items()
      }
      devices = sorted({node.device for node in meta_graph.graph_def.node})
      result = {
          "devices": devices,
          "signatures": signatures,
          "nodes": sorted(n.name for n in meta_graph.graph_def.node)
      }
      if name is None:
        return result
      signature = meta_graph.signature_def[name]
      feed = {
          graph.get_tensor_by_name(info.name): rows[key]
          for key, info in signature.inputs.items()
      }
      fetch = {
          key: graph.get_tensor_by_name(info.name)
          for key, info in signature.outputs.items()
      }
      try:
        outputs = session.run(fetch, feed)
      except tf.errors.OpError as e:
        return {"error": f"{type(e).__name__}: {e.message[:300]}"}
      result["outputs"] = {
          k: {
              "value": np.asarray(v).tolist(),
              "shape": list(np.shape(v))
          } for k, v in outputs.items() if np.asarray(v).dtype.kind in "fiub"
      }
      return result


def main(argv):
  directories = json.loads(argv[1])
  rows = dict(np.load(argv[2]))
  result = {"logical_cpus": len(tf.config.list_logical_devices("CPU"))}
  for export, directory in directories.items():
    for mode in sorted(TAGS):
      result[f"{export}/{mode}"] = _load(directory, TAGS[mode], RUN.get(mode),
                                         rows)
  print("RESULT " + json.dumps(result))


if __name__ == "__main__":
  main(sys.argv)
