"""The public namespace holds exactly the names DESIGN.md lists."""

import inspect
import pathlib

import tensorflow as tf

import replicate


def test_public_names_are_exactly_all():
  public = {name for name in dir(replicate) if not name.startswith("_")}
  assert public == set(replicate.__all__) == {
      "Tower", "TowerOptimizer", "VariablePlacement", "batch_concat",
      "batch_sum", "current_tower", "replicate_model_fn", "testing"
  }
  assert isinstance(replicate.__version__, str)


def test_testing_module_exports_exactly_all():
  public = {
      name for name in vars(replicate.testing) if not name.startswith("_") and
      getattr(vars(replicate.testing)[name], "__module__", "").startswith(
          "replicate.testing")
  }
  assert public == set(replicate.testing.__all__) == {
      "ReplicationMismatch", "Summary", "assert_replicates", "replicated",
      "run_config", "session_config", "virtual_cpus"
  }


def test_tower_is_what_current_tower_returns():
  tower = replicate.Tower(index=1, num_towers=2, device="/device:GPU:1")
  assert (tower.index, tower.num_towers, tower.device) == (1, 2,
                                                           "/device:GPU:1")
  assert tuple(tower) == (1, 2, "/device:GPU:1")  # unpacks as before
  assert replicate.current_tower() is None


def test_variable_placement_members_and_strings():
  assert replicate.VariablePlacement(
      "shared") is replicate.VariablePlacement.SHARED
  assert (replicate.VariablePlacement("round_robin")
          is replicate.VariablePlacement.ROUND_ROBIN)


def test_replicate_model_fn_signature():
  parameters = list(
      inspect.signature(replicate.replicate_model_fn).parameters.values())
  assert [p.name for p in parameters] == [
      "model_fn", "loss_reduction", "devices", "variable_placement",
      "sync_batch_norm"
  ]
  assert parameters[-1].default is True


def test_tower_optimizer_flavours():
  v1 = replicate.TowerOptimizer(tf.compat.v1.train.AdagradOptimizer(0.1))
  assert isinstance(v1, replicate.TowerOptimizer)
  assert isinstance(v1, tf.compat.v1.train.Optimizer)
  keras = replicate.TowerOptimizer(tf.keras.optimizers.legacy.Adagrad(0.1))
  assert isinstance(keras, tf.keras.optimizers.legacy.Optimizer)
  assert isinstance(keras, replicate.TowerOptimizer)
  assert not isinstance(
      tf.keras.optimizers.legacy.Adagrad(0.1), replicate.TowerOptimizer)
  assert not isinstance(
      tf.compat.v1.train.AdagradOptimizer(0.1), replicate.TowerOptimizer)
  lazy = replicate.TowerOptimizer(lambda: tf.keras.optimizers.legacy.Adam())
  assert isinstance(lazy(), tf.keras.optimizers.legacy.Optimizer)


def test_readme_lists_every_testing_name():
  readme = (pathlib.Path(__file__).resolve().parent.parent /
            "README.md").read_text()
  for name in replicate.testing.__all__:
    assert f"`{name}" in readme, name
  assert 'pytest_plugins = ["replicate.pytest_plugin"]' in readme
