"""`_tf.estimator_compat`: tf.estimator on TensorFlow 2.16+, nothing on 2.15-.

On every line, `import replicate` leaves the tf.estimator API users write
working. On 2.13 to 2.15 nothing is patched; on 2.16 and newer Keras 2 is
behind tf.keras, TensorFlow's missing internals are supplied, and what
cannot hold (Keras 3 touched first, Keras 3 asked for, no tf-keras of the
line, a missing internal) is an ImportError naming the fix that leaves no
half-set tf.estimator. The refusals run in fresh processes.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from replicate._tf import estimator_compat

_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
_NEW_LINE = estimator_compat.tf_version() >= (2, 16)
_new_line_only = pytest.mark.skipif(
    not _NEW_LINE, reason="TensorFlow <= 2.15 ships tf.estimator")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh Python with the suite's replicate."""
  environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **env)
  environ.pop("TF_USE_LEGACY_KERAS", None)
  environ.update(env)
  path = [p for p in (str(_ROOT), os.environ.get("PYTHONPATH")) if p]
  # In CI the checkout copy has no replicate/: the installed one is found.
  environ["PYTHONPATH"] = os.pathsep.join(path)
  return subprocess.run(
      [sys.executable, "-c", textwrap.dedent(code)],
      env=environ,
      capture_output=True,
      text=True,
      timeout=300)


def test_the_estimator_api_users_write_is_there():
  est = tf.estimator
  for name in ("Estimator", "RunConfig", "EstimatorSpec", "ModeKeys",
               "DNNClassifier", "LinearClassifier",
               "DNNLinearCombinedRegressor", "BinaryClassHead",
               "MultiClassHead", "RegressionHead", "train_and_evaluate",
               "TrainSpec", "EvalSpec", "LatestExporter", "BestExporter",
               "CheckpointSaverHook", "SessionRunHook", "StopAtStepHook",
               "WarmStartSettings"):
    assert hasattr(est, name), name
  assert hasattr(est.export, "ServingInputReceiver")
  assert hasattr(tf.compat.v1.estimator, "Estimator")
  assert hasattr(tf.compat.v1.estimator.tpu, "TPUEstimator")
  assert hasattr(tf.compat.v1.estimator.inputs, "numpy_input_fn")
  assert hasattr(tf.feature_column, "numeric_column")
  assert hasattr(tf.keras.optimizers, "legacy")
  assert estimator_compat.keras_2_package() == ("tf_keras"
                                                if _NEW_LINE else "keras")


def test_keras_layers_draw_seeds_after_set_random_seed():
  # tf-keras 2.16 drew them with a float bound, which Python 3.12 refuses.
  tf.keras.utils.set_random_seed(3)
  with tf.Graph().as_default():
    dense = tf.keras.layers.Dense(2)
    dense(tf.zeros([1, 2]))
  assert dense.kernel.shape == (2, 2)


def test_a_local_distribution_strategy_still_configures():
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  config = tf.estimator.RunConfig(train_distribute=strategy)
  assert config.train_distribute is strategy
  assert config.task_type == "worker" and config.num_worker_replicas == 1


@pytest.mark.skipif(_NEW_LINE, reason="TensorFlow >= 2.16 is patched")
def test_nothing_is_patched_up_to_2_15():
  result = _run("""
      import os
      import replicate
      import tensorflow as tf
      from tensorflow.python.distribute import estimator_training
      from tensorflow.python.util import tf_export
      print(os.environ.get("TF_USE_LEGACY_KERAS"),
            estimator_training.__file__.endswith("estimator_training.py"),
            hasattr(estimator_training, "CHIEF"),
            tf.estimator.__name__)
      """)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == [
      "None", "True", "True",
      "tensorflow_estimator.python.estimator.api._v2.estimator"
  ], result.stdout


@_new_line_only
def test_keras_2_and_the_supplied_internals_on_2_16_and_later():
  result = _run("""
      import os
      import replicate
      import tensorflow as tf
      from tensorflow.python.distribute import estimator_training
      print(os.environ["TF_USE_LEGACY_KERAS"], tf.keras.__name__,
            tf.compat.v1.layers.dense.__module__.split(".")[0],
            estimator_training.__doc__.endswith("(replicate)."))
      """)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == [
      "1", "tf_keras.api._v2.keras", "tf_keras", "True"
  ], result.stdout


@_new_line_only
def test_keras_import_paths_find_keras_2_after_tensorflow_was_imported():
  # TensorFlow imported first (TF_USE_LEGACY_KERAS unset then) points
  # `tensorflow.keras` at Keras 3; user code imports its layers that way.
  result = _run("""
      import tensorflow as tf
      import replicate
      from tensorflow.keras import backend
      from tensorflow.keras.layers import Dense
      from tensorflow.compat.v1.keras.layers import Dense as DenseV1
      import tensorflow.compat.v1.layers as layers_v1
      print(Dense.__module__.split(".")[0], DenseV1 is Dense,
            tf.keras.layers.Dense is Dense, backend.__name__.split(".")[0],
            layers_v1.dense is tf.compat.v1.layers.dense,
            layers_v1.dense.__module__.split(".")[0])
      """)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == [
      "tf_keras", "True", "True", "tf_keras", "True", "tf_keras"
  ], result.stdout


@_new_line_only
def test_tensorflow_python_estimator_names_tensorflow_estimators_modules():
  # TensorFlow 2.15's aliases, which DeepCTR imports its head from.
  result = _run("""
      import replicate
      from tensorflow.python.estimator.canned.head import _Head
      from tensorflow.python.estimator.canned import head
      from tensorflow_estimator.python.estimator.canned import head as real
      print(head is real, _Head is real._Head)
      """)
  assert result.returncode == 0, result.stderr
  assert result.stdout.split() == ["True", "True"], result.stdout


@_new_line_only
def test_the_distribute_coordinator_is_refused_naming_the_clusters():
  strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
  cluster = ('{"cluster": {"worker": ["localhost:1", "localhost:2"]}, '
             '"task": {"type": "worker", "index": 0}}')
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("TF_CONFIG", cluster)
    with pytest.raises(ValueError, match="TF_CONFIG clusters"):
      tf.estimator.RunConfig(train_distribute=strategy)


# What an ImportError of `import replicate` must leave: no tf.estimator, none
# of the supplied modules, no estimator API in tf_export.
_LEFT = textwrap.dedent("""
    import sys
    import tensorflow as tf
    from tensorflow.python.util import tf_export
    try:
      import replicate
    except ImportError as e:
      print("ImportError:", e)
    import os
    print("left:", os.environ.get("TF_USE_LEGACY_KERAS", "unset"),
          "estimator" in vars(tf),
          "tensorflow.python.distribute.estimator_training" in sys.modules,
          "tensorflow.python.tpu.tpu_embedding" in sys.modules,
          hasattr(tf_export, "ESTIMATOR_API_NAME"),
          "estimator" in tf_export.API_ATTRS)
    """)


def _refusal(result: subprocess.CompletedProcess) -> str:
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[-1].split()[2:] == ["False"] * 5, result.stdout
  assert lines[0].startswith("ImportError: replicate cannot provide "
                             "tf.estimator on TensorFlow 2."), result.stdout
  return lines[0]


@_new_line_only
def test_keras_3_touched_first_is_refused_naming_the_fix():
  result = _run("import tensorflow as tf\ntf.keras.layers\n" + _LEFT)
  message = _refusal(result)
  assert "tf.keras was touched before `import replicate` and is Keras 3" in (
      message)
  assert "Import replicate before anything uses tf.keras" in message


@_new_line_only
def test_keras_3_imported_by_module_path_first_is_refused():
  result = _run("from tensorflow.keras import layers\n" + _LEFT)
  message = _refusal(result)
  # The import set tf.keras to Keras 3's module.
  assert "tf.keras was touched before `import replicate` and is Keras 3" in (
      message)


@_new_line_only
def test_keras_3_asked_for_is_refused():
  message = _refusal(_run(_LEFT, TF_USE_LEGACY_KERAS="0"))
  assert "TF_USE_LEGACY_KERAS=0 asks for Keras 3" in message


@_new_line_only
def test_no_tf_keras_of_the_line_is_refused_naming_the_install():
  hide = """
      import importlib.metadata
      version = importlib.metadata.version

      def hidden(name):
        if name in ("tf-keras", "tf_keras"):
          raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

      importlib.metadata.version = hidden
      """
  message = _refusal(_run(textwrap.dedent(hide) + _LEFT))
  line = "%d.%d" % estimator_compat.tf_version()
  assert "tf-keras is not installed" in message
  assert f'pip install "tf-keras~={line}.0"' in message


@_new_line_only
def test_a_missing_internal_is_refused_and_undone():
  # tensorflow_estimator's API module made unimportable, as a TensorFlow
  # that lost another internal would leave it.
  block = ('import sys\nsys.modules["tensorflow_estimator.python.estimator.'
           'api._v2.estimator"] = None\n')
  result = _run(block + _LEFT)
  message = _refusal(result)
  assert "pip install \"tensorflow<2." in message
  assert result.stdout.splitlines()[-1].split()[1] == "unset"
