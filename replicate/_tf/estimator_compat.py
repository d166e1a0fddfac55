"""`tf.estimator` on TensorFlow 2.16 and newer, which no longer ship it.

TensorFlow 2.15 is the last line with `tf.estimator`; tensorflow-estimator
2.15.0, its last release, still runs on the newer lines once four of its
TensorFlow imports exist again and `tf.keras` is Keras 2 (the `tf-keras`
package, chosen by `TF_USE_LEGACY_KERAS`, which TensorFlow reads when
`tf.keras` is first touched). `ensure_estimator`, called by
`replicate/__init__.py` before anything touches `tf.keras`, does that, and
on TensorFlow 2.13 to 2.15 changes nothing. What it supplies:

- `tensorflow.python.distribute.estimator_training`: the local parts
  (RunConfig with a distribution strategy on one machine); the distribute
  coordinator behind its other parts left TensorFlow, and a config that
  needs it is refused naming replicate's TF_CONFIG clusters instead.
- `tensorflow.python.tpu.session_support`, `tpu_embedding` and
  `tpu_embedding_gradient`: names only, so TPUEstimator imports (it runs
  with `use_tpu=False`); TPU embeddings and TPU training raise.
- `tensorflow.python.estimator.*`, the module names TensorFlow 2.15
  shipped as aliases of tensorflow_estimator's (DeepCTR imports its heads
  and optimizers from there).
- `tf_export.ESTIMATOR_API_NAME` and its attribute names, the API name
  tensorflow_estimator exports its symbols under.
- `tensorflow.keras` (and `tensorflow.compat.v1.keras`, `.layers`, ...) as
  import paths: TensorFlow points them at Keras 3 when it is imported
  without `TF_USE_LEGACY_KERAS`; they are pointed at tf-keras's.
- tf-keras 2.16's seed draw after `tf.keras.utils.set_random_seed`, whose
  float bound Python 3.12 refuses, with an int bound.
- `tf.estimator`, `tf.compat.v1.estimator` and `tf.compat.v2.estimator`,
  set from tensorflow_estimator's generated API modules.

Where that cannot hold (Keras 3 already behind `tf.keras`, no `tf-keras`
of TensorFlow's line, a missing internal) it raises an ImportError naming
the cause and the fix, having undone what it changed.
"""

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import os
import random
import sys
import types
from typing import Any, Callable, Dict, List, NoReturn, Optional, Tuple

from absl import logging
import tensorflow as tf

# pylint: disable=protected-access,g-direct-tensorflow-import
from tensorflow.python.util import tf_export as _tf_export

# The newest line this layer was checked on (README's stack).
NEWEST_CHECKED = (2, 21)
_ESTIMATOR_API = "tensorflow_estimator.python.estimator.api"
_TRUE = ("true", "True", "1")
_COORDINATOR = (
    "The distribute coordinator (RunConfig(train_distribute=..., "
    "experimental_distribute=...) on a TF_CONFIG cluster or a remote "
    "cluster) was removed with tf.estimator in TensorFlow 2.16; on "
    "TensorFlow {version} replicate runs Estimators on TF_CONFIG clusters "
    "itself: wrap the model_fn with replicate.replicate_model_fn and leave "
    "out train_distribute (docs/several_machines.md).")
_TPU = ("TPU training and TPU embeddings of TPUEstimator were removed with "
        "tf.estimator in TensorFlow 2.16; on TensorFlow {version} "
        "TPUEstimator runs with use_tpu=False only.")

_done = False


def tf_version() -> Tuple[int, int]:
  """TensorFlow's (major, minor) line."""
  major, minor = tf.__version__.split(".")[:2]
  return int(major), int(minor)


def keras_2_package() -> str:
  """The package of the Keras 2 behind `tf.keras`: `keras` up to 2.15,
  `tf_keras` from 2.16 on (Keras 3 is `keras` there)."""
  return "tf_keras" if tf_version() >= (2, 16) else "keras"


def ensure_estimator() -> None:
  """Makes `tf.estimator` work as on TensorFlow 2.15; once per process."""
  global _done
  if _done:
    return
  if tf_version() < (2, 16):
    logging.info("TensorFlow %s ships tf.estimator: nothing patched for it.",
                 tf.__version__)
  elif "estimator" in vars(tf):
    logging.info("tf.estimator is already set on TensorFlow %s: kept.",
                 tf.__version__)
  else:
    setting = os.environ.get("TF_USE_LEGACY_KERAS")
    _check_keras()
    try:
      _supply()
    except ImportError:
      if setting is None:  # Keras 2 was selected for nothing.
        del os.environ["TF_USE_LEGACY_KERAS"]
      raise
  _done = True


# ------------------------------------------------------------------ Keras


def _refuse(cause: str, fix: str) -> NoReturn:
  raise ImportError(
      f"replicate cannot provide tf.estimator on TensorFlow {tf.__version__}: "
      f"{cause}. {fix}")


def _tf_keras_version() -> Optional[str]:
  for name in ("tf-keras", "tf_keras"):
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return None


def _keras_loaders() -> List[Tuple[str, Any]]:
  """TensorFlow's lazily loaded Keras endpoints, as set (not loaded)."""
  v1, v2 = tf.compat.v1, tf.compat.v2
  found = [(f"tf.{n}", vars(tf).get(n)) for n in ("keras", "losses", "metrics",
                                                  "optimizers", "initializers")]
  found += [("tf.compat.v1.keras", vars(v1).get("keras")),
            ("tf.compat.v1.layers", vars(v1).get("layers")),
            ("tf.compat.v1.nn.rnn_cell", vars(v1.nn).get("rnn_cell")),
            ("tf.compat.v2.keras", vars(v2).get("keras"))]
  return found


def _check_keras() -> None:
  """Refuses what keeps Keras 2 from `tf.keras`; else selects it."""
  line = "%d.%d" % tf_version()
  setting = os.environ.get("TF_USE_LEGACY_KERAS")
  if setting not in (None, "", *_TRUE):
    _refuse(
        f"TF_USE_LEGACY_KERAS={setting} asks for Keras 3 behind tf.keras, "
        "and tf.estimator needs Keras 2",
        "Unset TF_USE_LEGACY_KERAS or set it to 1.")
  for endpoint, module in _keras_loaders():
    # A loader TensorFlow has resolved has a name; Keras 2's starts tf_keras.
    name = vars(module).get("__name__") if module is not None else None
    if name is not None and not name.startswith("tf_keras"):
      _refuse(
          f"{endpoint} was touched before `import replicate` and is Keras 3 "
          f"({name}), and tf.estimator needs Keras 2",
          "Import replicate before anything uses tf.keras, or set "
          "TF_USE_LEGACY_KERAS=1 in the environment.")
  version = _tf_keras_version()
  if version is None or version.split(".")[:2] != line.split("."):
    found = f"tf-keras {version} is installed" if version else (
        "tf-keras is not installed")
    _refuse(f"tf.estimator needs Keras 2 of TensorFlow's line, and {found}",
            f'Install it: pip install "tf-keras~={line}.0".')
  os.environ["TF_USE_LEGACY_KERAS"] = "1"
  logging.info("Keras 2 (tf-keras %s) selected for tf.keras (TensorFlow %s).",
               version, tf.__version__)
  if tf_version() > NEWEST_CHECKED:
    logging.warning(
        "TensorFlow %s is newer than %d.%d, the newest line replicate's "
        "tf.estimator layer was checked on.", tf.__version__, *NEWEST_CHECKED)


# ---------------------------------------------------------- the internals


class _Undo:
  """What `_supply` changed, to undo when it cannot finish: attributes set,
  modules put in sys.modules, other steps. (tensorflow_estimator's modules
  imported on the way stay, as after any failed import.)"""

  def __init__(self) -> None:
    self.attributes: List[Tuple[Any, str, Any]] = []
    self.modules: List[str] = []
    self.steps: List[Callable[[], Any]] = []

  def set(self, owner: Any, name: str, value: Any) -> None:
    self.attributes.append((owner, name, vars(owner).get(name, _Undo)))
    setattr(owner, name, value)

  def __call__(self) -> None:
    for owner, name, value in reversed(self.attributes):
      if value is _Undo:
        delattr(owner, name)
      else:
        setattr(owner, name, value)
    for name in self.modules:
      sys.modules.pop(name, None)
    for step in self.steps:
      step()


def _module(undo: _Undo, name: str, doc: str, **names: Any) -> None:
  """Puts a module `name` holding `names` where imports find it, unless
  TensorFlow has it."""
  parent, _, child = name.rpartition(".")
  try:
    importlib.import_module(name)
    return
  except ImportError:
    pass
  module = types.ModuleType(name, doc)
  vars(module).update(names)
  sys.modules[name] = module
  undo.modules.append(name)
  undo.set(sys.modules[parent], child, module)


def _raises(message: str) -> Callable[..., NoReturn]:

  def raises(*args: Any, **kwargs: Any) -> NoReturn:
    del args, kwargs  # Whatever the call, it cannot run.
    raise NotImplementedError(message)

  return raises


def _estimator_training() -> Dict[str, Any]:
  """The local parts of TensorFlow 2.15's estimator_training."""
  coordinator = _COORDINATOR.format(version=tf.__version__)

  def init_run_config(config: Any, tf_config: Dict[str, Any]) -> None:
    # RunConfig with a distribution strategy: the strategies of
    # experimental_distribute become the config's own, as on 2.15.
    experimental = config._experimental_distribute
    for field in ("train_distribute", "eval_distribute"):
      strategy = getattr(experimental, field, None)
      if strategy is not None:
        if getattr(config, "_" + field):
          raise ValueError(f"Either `{field}` or `experimental_distribute."
                           f"{field}` can be set.")
        setattr(config, "_" + field, strategy)
    cluster = tf_config.get("cluster", {})
    if getattr(experimental, "remote_cluster",
               None) or (cluster and "master" not in cluster and
                         config._train_distribute):
      raise ValueError(coordinator)
    config._distribute_coordinator_mode = None
    config._init_distributed_setting_from_environment_var(tf_config)
    config._maybe_overwrite_session_config_for_distributed_training()

  def should_run_distribute_coordinator(config: Any) -> bool:
    if getattr(config, "_distribute_coordinator_mode", None):
      raise ValueError(coordinator)
    return False

  return dict(
      init_run_config=init_run_config,
      should_run_distribute_coordinator=should_run_distribute_coordinator,
      train_and_evaluate=_raises(coordinator),
      estimator_train=_raises(coordinator),
      estimator_evaluate=_raises(coordinator))


def _tpu_modules(undo: _Undo) -> None:
  """The TPU modules TPUEstimator imports, their TPU parts raising."""
  message = _TPU.format(version=tf.__version__)

  def missing(name: str) -> NoReturn:
    raise AttributeError(f"{name}: {message}")

  parameters = {
      name: type(name, (), {"__init__": _raises(message)})
      for name in ("AdagradParameters", "AdamParameters", "FtrlParameters",
                   "MomentumParameters", "ProximalAdagradParameters",
                   "RMSPropParameters", "StochasticGradientDescentParameters")
  }
  for name, names in (("session_support", {}), ("tpu_embedding", parameters),
                      ("tpu_embedding_gradient", {})):
    _module(
        undo,
        "tensorflow.python.tpu." + name,
        message,
        **names,
        __getattr__=missing)


_OLD_ESTIMATOR = "tensorflow.python.estimator"
_ESTIMATOR = "tensorflow_estimator.python.estimator"


def _is_old_module_name(name: str) -> bool:
  return name == _OLD_ESTIMATOR or name.startswith(_OLD_ESTIMATOR + ".")


class _EstimatorAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """`tensorflow.python.estimator[.x]` as tensorflow_estimator's module
  `tensorflow_estimator.python.estimator[.x]`, the alias TensorFlow 2.15
  shipped (each of its 31 modules re-exported every name, private ones
  too)."""

  def find_spec(self,
                fullname: str,
                path: Any = None,
                target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
    del path, target  # The alias is found by name alone.
    if not _is_old_module_name(fullname):
      return None
    target_name = _ESTIMATOR + fullname[len(_OLD_ESTIMATOR):]
    if importlib.util.find_spec(target_name) is None:
      return None
    return importlib.machinery.ModuleSpec(fullname, self)

  def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
    return importlib.import_module(_ESTIMATOR + spec.name[len(_OLD_ESTIMATOR):])

  def exec_module(self, module: Any) -> None:
    del module  # tensorflow_estimator's import ran it.


def _forget_old_module_names() -> None:
  for name in list(sys.modules):
    if _is_old_module_name(name):
      del sys.modules[name]


def _old_module_names(undo: _Undo) -> None:
  """`tensorflow.python.estimator.*`, which TensorFlow 2.16 dropped."""
  try:
    importlib.import_module(_OLD_ESTIMATOR)
    return
  except ImportError:
    pass
  finder = _EstimatorAliases()
  # First: the path finder would load tensorflow_estimator's files again
  # under the old names, as modules apart from tensorflow_estimator's.
  sys.meta_path.insert(0, finder)
  undo.steps.append(functools.partial(sys.meta_path.remove, finder))
  undo.steps.append(_forget_old_module_names)
  undo.steps.append(
      lambda: vars(sys.modules["tensorflow.python"]).pop("estimator", None))


def _api_name(undo: _Undo) -> None:
  """tf_export's `estimator` API, which TensorFlow 2.16 dropped."""
  if hasattr(_tf_export, "ESTIMATOR_API_NAME"):
    return
  undo.set(_tf_export, "ESTIMATOR_API_NAME", "estimator")
  for table, suffix in ((_tf_export.API_ATTRS, ""), (_tf_export.API_ATTRS_V1,
                                                     "_v1")):
    attributes = type(next(iter(table.values())))
    table["estimator"] = attributes(f"_estimator_api_names{suffix}",
                                    f"_estimator_api_constants{suffix}")
    undo.steps.append(functools.partial(table.pop, "estimator", None))


def _keras_import_paths(undo: _Undo) -> None:
  """`from tensorflow.keras.layers import Dense` and the like find Keras 2.

  TensorFlow puts Keras's API folders first in its packages' `__path__`
  when it is imported, Keras 3's unless `TF_USE_LEGACY_KERAS` was set
  then; tf-keras's folders go before them (as TensorFlow puts them when
  the variable is set first)."""
  spec = importlib.util.find_spec("tf_keras")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("tf_keras has no package folder")
  api = os.path.join(spec.submodule_search_locations[0], "api")
  legacy = os.path.join(api, "_v1", "keras", "__internal__", "legacy")
  v1 = tf.compat.v1
  for module, folder in ((tf, os.path.join(api,
                                           "_v2")), (tf.compat.v2,
                                                     os.path.join(api, "_v2")),
                         (v1, os.path.join(api, "_v1")), (v1, legacy),
                         (v1.nn, legacy)):
    path = list(module.__path__)
    if path[:1] != [folder]:
      undo.set(module, "__path__", [folder] + path)


def _seed_fix(undo: _Undo) -> None:
  """tf-keras 2.16 draws a layer's seed after `tf.keras.utils.set_random_seed`
  as `randint(1, 1e9)`, a float bound Python 3.12 refuses
  (`RandomGenerator._create_seed`); where its source has that call, the
  same draw with an int bound takes its place."""
  backend = importlib.import_module("tf_keras.src.backend")
  generator = backend.RandomGenerator
  try:
    source = inspect.getsource(generator._create_seed)
  except (OSError, TypeError):  # No source: nothing to tell.
    return
  if "randint(1, 1e9)" not in source:
    return

  def create_seed(self: Any, user_specified_seed: Any) -> Any:
    del self  # The draw is the module's, as in tf-keras.
    if user_specified_seed is not None:
      return user_specified_seed
    seeded = getattr(backend._SEED_GENERATOR, "generator", None)
    return (seeded or random).randint(1, int(1e9))

  undo.set(generator, "_create_seed", create_seed)
  logging.info(
      "tf-keras %s's seed draw given an int bound (its float bound "
      "fails on Python 3.12+).", _tf_keras_version())


def _supply() -> None:
  """Supplies the internals, imports tensorflow_estimator and sets
  `tf.estimator`; undoes it all on the first failure."""
  undo = _Undo()
  try:
    _module(undo, "tensorflow.python.distribute.estimator_training",
            "The local parts of estimator_training (replicate).",
            **_estimator_training())
    _tpu_modules(undo)
    _old_module_names(undo)
    _api_name(undo)
    v2 = importlib.import_module(_ESTIMATOR_API + "._v2.estimator")
    v1 = importlib.import_module(_ESTIMATOR_API + "._v1.estimator")
    for owner, module in ((tf, v2), (tf.compat.v2, v2), (tf.compat.v1, v1)):
      undo.set(owner, "estimator", module)
    if not (tf.keras.__name__.startswith("tf_keras") and
            hasattr(tf.keras.optimizers, "legacy")):
      raise ImportError(f"tf.keras is {tf.keras.__name__}, not Keras 2")
    _keras_import_paths(undo)
    _seed_fix(undo)
  except (ImportError, AttributeError) as e:
    undo()
    _refuse(
        f"{type(e).__name__}: {e}", "tensorflow-estimator 2.15 with tf-keras "
        f"of TensorFlow's line runs on TensorFlow 2.16 to "
        f"{NEWEST_CHECKED[0]}.{NEWEST_CHECKED[1]}; install one of those "
        "(pip install \"tensorflow<2.%d\")." % (NEWEST_CHECKED[1] + 1))
  logging.info(
      "tf.estimator set from tensorflow-estimator %s on TensorFlow %s "
      "(estimator_training's local parts and TPU names supplied).",
      importlib.metadata.version("tensorflow-estimator"), tf.__version__)
