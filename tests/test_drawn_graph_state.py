"""Model_fns drawn from a grammar of graph-state uses see one device's graph.

A drawn `Case` says which graph state a model_fn reads and writes, in
order: collections (regularization losses from layers, `get_variable`'s
regularizer and `add_loss`, a custom 'losses' key summed by `add_n`,
UPDATE_OPS), scoped reads (`get_regularization_loss(scope)`,
`trainable_variables(scope)`), moving averages of tensors and zero-debiased
ones, variables picked by a marker counted before the layers, variable
scopes opened with `default_name`, a variable and a name scope of the same
name, a Keras layer object shared by every call, and TF Hub's check that a
variable scope and its name scope agree. Every call also records what it
reads of the graph at each point (variable names, the variable scope,
the regularization losses, the collections' lengths).

Each case runs unreplicated and on N towers (uneven batches) from the same
seeded weights: every tower's records must be one device's (the tower's
`tower_i` name segment left out), and the losses and every variable equal.
The default run draws a sample; `pytest -m drawn` draws many more.
"""

import dataclasses
from typing import Any, Dict, List, Tuple

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.training import moving_averages  # pylint: disable=g-direct-tensorflow-import

from tests import harness

pytestmark = pytest.mark.drawn

FEATURES = 3
CLASSES = 3
STEPS = 2
_EXAMPLES = 12
_MANY = 300
_GraphKeys = tf.compat.v1.GraphKeys

USES = ("layer_regularizer", "variable_regularizer", "add_loss", "losses_key",
        "moving_average", "zero_debias", "default_name", "named_twice",
        "shared_layer", "hub_scopes", "batch_norm", "observe")


@dataclasses.dataclass(frozen=True)
class Case:
  """How one drawn model_fn uses graph state, and what it runs on."""
  uses: Tuple[str, ...]
  scope: str  # the variable scope the model is built in ('' for none)
  var_list: str  # "all", "marker" or "scoped"
  mode: str
  batch: int
  towers: int
  static: bool


@st.composite
def cases(draw) -> Case:
  towers = draw(st.integers(2, 4))
  return Case(
      uses=tuple(draw(st.lists(st.sampled_from(USES), min_size=1, max_size=6))),
      scope=draw(st.sampled_from(["", "net"])),
      var_list=draw(st.sampled_from(["all", "marker", "scoped"])),
      mode=draw(st.sampled_from([harness.TRAIN, harness.EVAL])),
      batch=draw(st.integers(towers, 9)),
      towers=towers,
      static=draw(st.booleans()))


def _towerless(name: str) -> str:
  return "/".join(
      part for part in name.split("/") if not part.startswith("tower_"))


def _observe(records: List[Any]) -> None:
  """What a call reads of its graph now."""
  graph = tf.compat.v1.get_default_graph()
  records.append((
      [v.op.name for v in tf.compat.v1.global_variables()],
      [v.op.name for v in tf.compat.v1.trainable_variables()],
      tf.compat.v1.get_variable_scope().name,
      [t.op.name for t in tf.compat.v1.losses.get_regularization_losses()],
      len(tf.compat.v1.get_collection("losses")),
      len(tf.compat.v1.get_collection(_GraphKeys.UPDATE_OPS)),
      graph.unique_name("probe", mark_as_used=False),
  ))


def _hub_scopes() -> tf.compat.v1.VariableScope:
  """TF Hub's check (module.py) that a new variable scope's name scope
  agrees with it, then the scope."""
  graph = tf.compat.v1.get_default_graph()
  name = tf.compat.v1.get_variable_scope().name
  with tf.name_scope(name + "/" if name else ""):
    with tf.compat.v1.variable_scope(
        None, default_name="module", auxiliary_name_scope=False) as scope:
      wanted = scope.name + "/"
    taken = graph.unique_name("module", mark_as_used=True) + "/"
  if taken != wanted:
    raise RuntimeError(f"variable_scope {wanted} was unused but the "
                       f"corresponding name_scope was already taken")
  return scope


class _Model:
  """One graph's model_fn (its shared layer object is its own)."""

  def __init__(self, case: Case) -> None:
    self.case = case
    self.records: List[List[Any]] = []
    self.shared = None  # made by the first call, called by every call
    self.inputs = None

  def __call__(self, features, labels, mode, params=None):
    del params
    case, records = self.case, []
    self.records.append(records)
    start = len(tf.compat.v1.trainable_variables())
    hidden, terms, updates = features["x"], [], []
    self.inputs = features["x"]
    scope = (
        tf.compat.v1.variable_scope(case.scope) if case.scope else
        tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope()))
    with scope:
      for index, use in enumerate(case.uses):
        hidden = self._use(use, index, hidden, terms, updates, records, mode)
      logits = tf.compat.v1.layers.dense(hidden, CLASSES, name="logits")
    loss = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
    loss += tf.add_n([loss * 0.0] + terms)
    if tf.compat.v1.get_collection("losses"):
      loss += tf.add_n(tf.compat.v1.get_collection("losses"))
    loss += tf.compat.v1.losses.get_regularization_loss()
    _observe(records)
    if mode == harness.EVAL:
      return tf.estimator.EstimatorSpec(
          mode,
          loss=loss,
          eval_metric_ops={"mean": tf.compat.v1.metrics.mean(loss)})
    if "moving_average" in case.uses:
      average = tf.compat.v1.train.ExponentialMovingAverage(0.9, name="avg")
      updates.append(average.apply([loss]))
    updates += tf.compat.v1.get_collection(_GraphKeys.UPDATE_OPS)
    variables = {
        "all": None,
        "marker": tf.compat.v1.trainable_variables()[start:],
        "scoped": tf.compat.v1.trainable_variables(case.scope or None),
    }[case.var_list]
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with tf.control_dependencies(updates):
      train_op = optimizer.minimize(
          loss, tf.compat.v1.train.get_global_step(), var_list=variables)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  def _use(self, use, index, hidden, terms, updates, records, mode):
    penalty = tf.keras.regularizers.l2(0.05)
    width = hidden.shape[-1]
    if use == "layer_regularizer":
      return tf.compat.v1.layers.dense(
          hidden, 4, tf.nn.tanh, kernel_regularizer=penalty)
    if use == "variable_regularizer":
      with tf.compat.v1.variable_scope(f"D{index}") as scope:
        kernel = tf.compat.v1.get_variable(
            "kernel", [width, 3], regularizer=penalty)
      terms.append(
          tf.compat.v1.losses.get_regularization_loss(f"D{index}") +
          tf.compat.v1.losses.get_regularization_loss(scope.name) +
          tf.compat.v1.losses.get_regularization_loss(f".*D{index}"))
      return tf.matmul(hidden, kernel)
    if use == "add_loss":
      hidden = tf.compat.v1.layers.dense(hidden, 3, name=f"penalized{index}")
      kernel = tf.compat.v1.trainable_variables()[-2]
      tf.compat.v1.losses.add_loss(0.1 * tf.nn.l2_loss(kernel),
                                   _GraphKeys.REGULARIZATION_LOSSES)
      return hidden
    if use == "losses_key":
      tf.compat.v1.add_to_collection(
          "losses", 0.1 * tf.reduce_mean(tf.square(hidden), name="decay"))
      return hidden
    if use == "zero_debias":
      average = tf.compat.v1.get_variable(
          f"average{index}", [],
          initializer=tf.zeros_initializer(),
          trainable=False)
      if mode == harness.TRAIN:
        updates.append(
            moving_averages.assign_moving_average(
                average, tf.reduce_mean(hidden), 0.9, zero_debias=True))
      return hidden + 0.0 * average
    if use == "default_name":
      for _ in range(2):
        with tf.compat.v1.variable_scope(None, default_name="block"):
          hidden = tf.compat.v1.layers.dense(hidden, 3, tf.nn.relu)
      return hidden
    if use == "named_twice":
      first = tf.Variable(0.0, name=f"tp{index}", trainable=False)
      with tf.name_scope(f"tp{index}"):
        count = tf.Variable(0.0, name="count", trainable=False)
      updates.extend(
          [first.assign_add(tf.reduce_sum(hidden)),
           count.assign_add(1.0)])
      return hidden + 0.0 * (first + count)
    if use == "shared_layer":
      if self.shared is None:
        self.shared = tf.keras.layers.Dense(2, name="shared_object")
      return tf.concat([hidden, self.shared(self.inputs)], axis=1)
    if use == "hub_scopes":
      with tf.compat.v1.variable_scope(
          _hub_scopes(), auxiliary_name_scope=False):
        kernel = tf.compat.v1.get_variable("kernel", [width, 3])
      return tf.matmul(hidden, kernel)
    if use == "moving_average":  # applied to the loss, after the towers' end
      return hidden
    if use == "batch_norm":
      return tf.compat.v1.layers.batch_normalization(
          hidden, training=mode == harness.TRAIN)
    assert use == "observe"
    _observe(records)
    return hidden


def _data() -> Tuple[Dict[str, np.ndarray], np.ndarray]:
  rng = np.random.RandomState(0)
  return ({
      "x": rng.randn(40, FEATURES).astype(np.float32)
  }, rng.randint(0, CLASSES, 40).astype(np.int64))


def _run(case: Case, towers: int):
  model = _Model(case)
  devices = None if towers == 1 else harness.devices(harness.VIRTUAL_CPUS,
                                                     towers)
  run = harness.train if case.mode == harness.TRAIN else harness.evaluate
  results = run(
      model,
      _data(),
      case.batch,
      STEPS,
      tower_devices=devices,
      static=case.static)
  return results, model.records


def _records_towerless(records):
  return [[
      tf.nest.map_structure(
          lambda x: _towerless(x)
          if isinstance(x, str) else x, record) for record in call
  ] for call in records]


def _assert_same(case: Case) -> None:
  (expected, expected_values), one_device = _run(case, 1)
  (actual, values), calls = _run(case, case.towers)
  assert len(calls) == case.towers
  for call in _records_towerless(calls):
    assert call == one_device[0]
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
  assert sorted(values) == sorted(expected_values)
  for name, value in expected_values.items():
    np.testing.assert_allclose(
        values[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_drawn_graph_state_uses_see_one_devices_graph(request):
  marked = "drawn" in (request.config.getoption("markexpr") or "")

  @hypothesis.settings(
      max_examples=_MANY if marked else _EXAMPLES,
      deadline=None,
      suppress_health_check=list(hypothesis.HealthCheck),
      print_blob=True,
      database=None)
  @hypothesis.given(case=cases())
  def check(case):
    _assert_same(case)

  check()
