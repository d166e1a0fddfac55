"""Test set-up: quiet TensorFlow logs; graph mode is per test (tf.Graph).

The host CPU is split into 4 logical devices before TensorFlow initialises,
so that '/device:CPU:0'..'/device:CPU:3' exist for every test, as
`replicate` checks device names against the local devices (sessions that
ask for `device_count={'CPU': 4}` get the same four). GPUs are hidden, so
the '/device:GPU:N' cases run by soft placement on the CPU on every machine
(with one real GPU, '/device:GPU:1..3' would not exist) and compare float32
results without TF32 matmuls, unless REPLICATE_TEST_GPUS splits a real GPU
(BUILD.md).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# On a machine with a GPU, every TensorFlow process of the run (xdist
# workers, and the clusters, examples and benchmarks the tests start)
# takes GPU memory as it needs it: one that took all of it would leave the
# others none.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

# On TensorFlow 2.16+ replicate sets up tf.estimator and Keras 2 behind
# tf.keras, which must come before anything touches tf.keras.
import replicate  # pylint: disable=g-import-not-at-top

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)


def _legacy_tf_layers():
  """TensorFlow's tensorflow.python.layers.normalization (which tf-slim's
  batch_norm builds on) loads `tf_keras.legacy_tf_layers` (2.15 and
  later) or `keras.legacy_tf_layers` (2.13, 2.14), which no package of these
  stacks provides; Keras 2 has it as keras.src.legacy_tf_layers (up to
  2.15) or tf_keras.src.legacy_tf_layers (2.16 and later)."""
  import importlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  from replicate._tf import estimator_compat  # pylint: disable=g-import-not-at-top
  try:
    normalization = importlib.import_module(
        estimator_compat.keras_2_package() +
        ".src.legacy_tf_layers.normalization")
  except ImportError:
    return
  for name in ("tf_keras.legacy_tf_layers.normalization",
               "keras.legacy_tf_layers.normalization"):
    try:
      importlib.import_module(name)
    except ImportError:
      sys.modules[name] = normalization


_legacy_tf_layers()
# REPLICATE_TEST_GPUS=N (a machine with a GPU): the first GPU split into N
# logical GPUs of REPLICATE_TEST_GPU_MEMORY_MB each, so the '/device:GPU:N'
# cases run on it; float32 matmuls without TF32, as on the CPU.
_TEST_GPUS = int(os.environ.get("REPLICATE_TEST_GPUS", "0"))
_PHYSICAL_GPUS = tf.config.list_physical_devices("GPU")
if _TEST_GPUS and not _PHYSICAL_GPUS:
  raise pytest.UsageError(
      f"REPLICATE_TEST_GPUS={_TEST_GPUS} asks for the GPU cases to run on a "
      "real GPU, but TensorFlow sees no GPU on this machine (a CPU-only "
      "TensorFlow, or no driver); unset REPLICATE_TEST_GPUS to run them on "
      "the CPU by soft placement.")
if _TEST_GPUS:
  tf.config.set_visible_devices(_PHYSICAL_GPUS[:1], "GPU")
  tf.config.set_logical_device_configuration(_PHYSICAL_GPUS[0], [
      tf.config.LogicalDeviceConfiguration(
          memory_limit=int(
              os.environ.get("REPLICATE_TEST_GPU_MEMORY_MB", "1024")))
  ] * _TEST_GPUS)
  tf.config.experimental.enable_tensor_float_32_execution(False)
else:
  tf.config.set_visible_devices([], "GPU")
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * 4)

# `pytester` runs the pytest plugin's own test in a fresh pytest.
pytest_plugins = ["pytester"]


def pytest_addoption(parser):
  parser.addoption(
      "--replicate-placement",
      default=None,
      choices=["shared", "round_robin", "mirrored"],
      help="the placement replicate_model_fn takes by default for several "
      "towers of any device type (variable_placement=None), to run the "
      "whole suite under it (BUILD.md)")


def pytest_configure(config):
  placement = config.getoption("--replicate-placement", default=None)
  if placement:
    from replicate._prepare import devices  # pylint: disable=g-import-not-at-top
    forced = devices.VariablePlacement(placement)
    devices.default_placement = lambda towers: (
        forced if len(towers) > 1 else devices.VariablePlacement.SHARED)
    os.environ["REPLICATE_FORCED_PLACEMENT"] = placement


def pytest_collection_modifyitems(config, items):
  """Cases marked `wide` run only when asked for (`-m wide`, or
  REPLICATE_WIDE=1): the default run keeps one case of each behaviour,
  to stay within its time budget (BUILD.md)."""
  if "wide" in (config.getoption("markexpr") or
                "") or os.environ.get("REPLICATE_WIDE") == "1":
    return
  skip = pytest.mark.skip(reason="wide case: run with `-m wide` or "
                          "REPLICATE_WIDE=1")
  for item in items:
    if "wide" in item.keywords:
      item.add_marker(skip)


def forced_placement():
  """The placement --replicate-placement forces, or None."""
  return os.environ.get("REPLICATE_FORCED_PLACEMENT")


def pytest_report_header(config):
  """Which replicate is tested: the checkout's, or an installed wheel's."""
  del config
  return (f"replicate {replicate.__version__} from "
          f"{os.path.dirname(replicate.__file__)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """A known bug of tensorflow_estimator 2.13 on Python 3.11 is a skip.

  Its canned v2 estimators look up an optimizer's default learning rate
  with `inspect.getargspec`, which Python 3.11 removed: a DNN estimator
  given an optimizer name, or its default, fails there unreplicated too.
  Only that AttributeError is turned into a skip; 2.14 and later use
  `getfullargspec`.
  """
  outcome = yield
  report = outcome.get_result()
  if (call.when == "call" and report.failed and call.excinfo is not None and
      call.excinfo.errisinstance(AttributeError) and
      "'getargspec'" in str(call.excinfo.value)):
    report.outcome = "skipped"
    report.longrepr = (
        str(item.path), item.location[1] or
        0, "Skipped: tensorflow_estimator calls inspect.getargspec, "
        "gone in this Python; the unreplicated canned estimator "
        "fails the same way")
