"""One device's result by construction: the cases that once broke it.

Each test runs a model_fn as a user writes it on one device and on 2 and 4
towers, from the same seeded weights, and compares losses and every
variable after training (or metrics, or the error a model_fn that cannot
be replicated gets):

- libraries that keep Python state between calls (tf-slim's arg_scope
  stack, a model object storing tensors on itself): the towers are built
  one after another, never interleaved;
- whole-batch values written in any algebraic form (a hand-written masked
  mean, scaled and weighted sums of losses, a metric of a tf.py_func);
- the regressions of the optimizer routing and sparse-width changes;
- optimizer calls inside tf.cond (gradient accumulation);
- towers that build different models.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim

import replicate
from tests import harness

TRAIN, EVAL = harness.TRAIN, harness.EVAL
TOWERS = (2, 4)
# TOWERS as the default run takes them: 4, and 2 `wide`.
ON_4 = [harness.wide(2), 4]


def _towers(n):
  return harness.devices(harness.VIRTUAL_CPUS, n)


def _data(num_examples=24, seed=0, features=5):
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, features).astype(np.float32)
  y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int64)
  return {"x": x}, y


def _assert_trains_as_one_device(model_fn,
                                 data,
                                 batch,
                                 steps,
                                 towers,
                                 static=True,
                                 params=None,
                                 rtol=1e-5,
                                 atol=1e-6):
  """Losses and every variable after `steps` steps, N towers vs one device."""
  expected_losses, expected = harness.train(
      model_fn, data, batch, steps, params=params, static=static)
  losses, actual = harness.train(
      model_fn,
      data,
      batch,
      steps,
      tower_devices=_towers(towers),
      params=params,
      static=static)
  np.testing.assert_allclose(losses, expected_losses, rtol=rtol, atol=atol)
  assert sorted(actual) == sorted(expected)
  for name in expected:
    np.testing.assert_allclose(
        actual[name], expected[name], rtol=rtol, atol=atol, err_msg=name)
  return expected_losses, expected


def _in_turns(forms):
  """(form, towers) params of each form on TOWERS, ids `form-towers`: the
  default run keeps each form on one of them, in turn, the others `wide`."""
  return [(pytest.param if j == i % len(TOWERS) else harness.wide)(
      form, towers, id=f"{form}-{towers}")
          for i, form in enumerate(forms)
          for j, towers in enumerate(TOWERS)]


def _sgd(rate=0.5):
  return tf.compat.v1.train.GradientDescentOptimizer(rate)


def _spec(mode, loss, optimizer=None, **kwargs):
  train_op = None
  if mode == TRAIN:
    train_op = (optimizer or
                _sgd()).minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=train_op, **kwargs)


# --------------------------------------------- Python state between calls


def _images(num_examples=12, seed=1):
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, 6, 6, 2).astype(np.float32)
  return {"x": x}, (x.mean(axis=(1, 2, 3)) > 0).astype(np.int64)


def _slim_model_fn(features, labels, mode, params):
  """tf-slim: convolutions with batch norm in an arg_scope, logits outside.

  `params['both_inside']`: both hidden convolutions in the arg_scope that
  holds batch norm (else the second outside it), the logits convolution
  (with biases) outside.
  """
  training = mode == TRAIN
  with slim.arg_scope([slim.conv2d],
                      activation_fn=tf.nn.relu6,
                      weights_regularizer=slim.l2_regularizer(0.05),
                      normalizer_fn=slim.batch_norm,
                      normalizer_params={
                          "is_training": training,
                          "decay": 0.9
                      }):
    net = slim.conv2d(features["x"], 4, [3, 3], scope="conv1")
    if params["both_inside"]:
      net = slim.conv2d(net, 4, [3, 3], scope="conv2")
  if not params["both_inside"]:
    net = slim.conv2d(net, 4, [3, 3], scope="conv2")
  logits = slim.conv2d(
      net, 2, [6, 6], padding="VALID", activation_fn=None, scope="logits")
  logits = tf.squeeze(logits, [1, 2])
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  loss += tf.compat.v1.losses.get_regularization_loss()
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    return _spec(mode, loss, _sgd(0.1))


@pytest.mark.parametrize("both_inside,towers", _in_turns([False, True]))
def test_tf_slim_arg_scopes_around_batch_norm(towers, both_inside):
  _, values = _assert_trains_as_one_device(
      _slim_model_fn,
      _images(),
      12,
      3,
      towers,
      params={"both_inside": both_inside})
  assert np.abs(values["conv1/BatchNorm/moving_mean"]).max() > 1e-3


class _Ranker:
  """A model object as TensorFlow Ranking's: made once, called in every
  model_fn call, it keeps tensors on itself between its steps and reads
  them back after a call that needs every tower (batch norm)."""

  def compute_logits(self, features, training):
    self.mask = tf.cast(features["x"][:, :1] > -1.0, tf.float32)
    self.rows = tf.reshape(features["x"], [-1, 5])
    normalized = tf.compat.v1.layers.batch_normalization(
        self.rows, training=training, name="bn")
    scored = tf.compat.v1.layers.dense(normalized, 1, name="score")
    return tf.reshape(scored, tf.shape(self.mask)) * self.mask


def _ranking_model_fn(ranker):

  def model_fn(features, labels, mode, params):
    del params
    logits = ranker.compute_logits(features, mode == TRAIN)
    loss = tf.compat.v1.losses.sigmoid_cross_entropy(
        tf.cast(labels[:, None], tf.float32), logits, weights=ranker.mask)
    update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(update_ops):
      return _spec(mode, loss)

  return model_fn


@pytest.mark.parametrize(
    "towers,batch",
    [harness.wide(2, 8), harness.wide(2, 9), (4, 10)])
def test_a_model_object_keeping_tensors_between_calls(towers, batch):
  _assert_trains_as_one_device(
      _ranking_model_fn(_Ranker()), _data(30), batch, 3, towers, static=False)


# ------------------------------------------ whole-batch values, any form


def _masked_data():
  """6 rows; the mask keeps 3 of tower 0's rows and 1 of tower 1's."""
  x, y = _data(6)
  x["mask"] = np.array([1, 1, 1, 0, 0, 1], np.float32)
  return x, y


def _masked_mean_model_fn(features, labels, mode, params):
  del params
  logits = tf.squeeze(tf.compat.v1.layers.dense(features["x"], 1, name="w"), 1)
  err = tf.square(logits - tf.cast(labels, tf.float32))
  mask = features["mask"]
  loss = tf.reduce_sum(err * mask) / tf.reduce_sum(mask)
  return _spec(mode, loss)


@pytest.mark.parametrize("towers", ON_4)
def test_a_hand_written_masked_mean_is_one_devices(towers):
  # Default loss_reduction: nothing says the loss divides by a batch count.
  losses, _ = _assert_trains_as_one_device(_masked_mean_model_fn,
                                           _masked_data(), 6, 2, towers)
  assert losses[0] > 0.1


def _losses(features, labels, form):
  logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
  first = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  second = tf.compat.v1.losses.mean_squared_error(
      tf.cast(labels, tf.float32), logits[:, 1])
  if form == "scaled":
    return 0.5 * first
  if form == "identity_scaled":
    return 1.0 * first
  if form == "weighted_sum":
    return tf.add_n([1.0 * first, 0.5 * second])
  if form == "max":
    return first + tf.reduce_max(tf.abs(logits))
  if form == "per_batch":
    return tf.reduce_sum(tf.square(logits)) / tf.cast(
        tf.shape(logits)[0], tf.float32)
  raise ValueError(form)


def _loss_form_model_fn(features, labels, mode, params):
  loss = _losses(features, labels, params["form"])
  metrics = None
  if mode == EVAL:
    metrics = {"loss_mean": tf.compat.v1.metrics.mean(loss)}
  return _spec(mode, loss, eval_metric_ops=metrics)


FORMS = ["scaled", "identity_scaled", "weighted_sum", "max", "per_batch"]


@pytest.mark.parametrize("form,towers", _in_turns(FORMS))
def test_losses_in_any_algebraic_form_train_as_one_device(form, towers):
  _assert_trains_as_one_device(
      _loss_form_model_fn, _data(14), 7, 2, towers, params={"form": form})


@pytest.mark.parametrize("form", FORMS)
def test_losses_in_any_algebraic_form_evaluate_as_one_device(form):
  params = {"form": form}
  expected = harness.evaluate(
      _loss_form_model_fn, _data(14), 7, 2, params=params)
  for towers in TOWERS:
    actual = harness.evaluate(
        _loss_form_model_fn, _data(14), 7, 2, _towers(towers), params=params)
    harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)


def _bleu(labels, classes):
  """A per-batch score computed in Python, as the Transformer's BLEU."""
  return np.float32(np.mean(labels == classes)**2 + 0.01 * len(labels))


def _py_func_metric_model_fn(features, labels, mode, params):
  del params
  logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  score = tf.compat.v1.py_func(_bleu, [labels, tf.argmax(logits, 1)],
                               tf.float32)
  return _spec(
      mode, loss, eval_metric_ops={"bleu": tf.compat.v1.metrics.mean(score)})


def test_a_metric_of_a_py_func_runs_it_on_the_whole_batch():
  expected = harness.evaluate(_py_func_metric_model_fn, _data(21), 7, 3)
  for towers in TOWERS:
    actual = harness.evaluate(_py_func_metric_model_fn, _data(21), 7, 3,
                              _towers(towers))
    harness.assert_close_nests(actual, expected, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------ regressions


def test_an_optimizer_called_in_one_tower_only_is_an_error():
  calls = []

  def model_fn(features, labels, mode, params):
    del params
    calls.append(1)
    logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
    d = tf.compat.v1.get_variable(
        "d", [], initializer=tf.constant_initializer(2.0))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = _sgd().minimize(loss, tf.compat.v1.train.get_global_step())
    if len(calls) == 1:  # "the first call only", a Python counter
      train_op = tf.group(train_op, _sgd(1.0).minimize(tf.square(d) * 0.75))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(
      ValueError,
      match=r"Tower 1 made 2 calls that need "
      r"every tower but tower 0 made 1.*Python counter"):
    harness.train(model_fn, _data(), 8, 1, tower_devices=_towers(2))


@pytest.mark.parametrize("towers", ON_4)
def test_a_write_ordered_before_compute_gradients_runs_once(towers):

  def model_fn(features, labels, mode, params):
    del params
    logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    calls = tf.compat.v1.get_variable(
        "calls", [], initializer=tf.zeros_initializer(), trainable=False)
    optimizer = _sgd()
    with tf.control_dependencies([calls.assign_add(1.0)]):
      grads = optimizer.compute_gradients(loss)
    return tf.estimator.EstimatorSpec(
        mode,
        loss=loss,
        train_op=optimizer.apply_gradients(
            grads, tf.compat.v1.train.get_global_step()))

  _, values = _assert_trains_as_one_device(model_fn, _data(), 8, 3, towers)
  assert values["calls"] == 3.0


def _fixed_width_sparse_model_fn(features, labels, mode, params):
  del params
  weight = tf.compat.v1.get_variable("weight", [4, 1])
  scores = tf.squeeze(tf.sparse.sparse_dense_matmul(features["ids"], weight), 1)
  loss = tf.compat.v1.losses.mean_squared_error(labels, scores)
  return _spec(
      mode, loss, predictions={"dense": tf.sparse.to_dense(features["ids"])})


def _fixed_width_sparse_step(towers):
  """The loss and the densified feature of one step (4 columns wide; the
  first half of the rows, tower 0's on 2 towers, reach column 2 only)."""
  indices = [[0, 0], [1, 2], [2, 1], [3, 2], [4, 0], [5, 3], [6, 2], [7, 1]]
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    sparse = tf.SparseTensor(
        tf.constant(indices, tf.int64),
        tf.constant(np.arange(1.0, 9.0, dtype=np.float32)),
        tf.constant([8, 4], tf.int64))
    labels = tf.constant(np.linspace(-1, 1, 8, dtype=np.float32))
    spec = harness.wrap(_fixed_width_sparse_model_fn, towers and
                        _towers(towers))({
                            "ids": sparse
                        }, labels, TRAIN, {})
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      harness.set_trainable_weights(session)
      return session.run((spec.loss, spec.predictions))


@pytest.mark.parametrize("towers", ON_4)
def test_a_fixed_width_sparse_feature_keeps_its_width(towers):
  expected = _fixed_width_sparse_step(None)
  actual = _fixed_width_sparse_step(towers)
  np.testing.assert_allclose(actual[0], expected[0], rtol=1e-6)
  np.testing.assert_array_equal(actual[1]["dense"], expected[1]["dense"])
  assert actual[1]["dense"].shape == (8, 4)


def _keras_minimize_model_fn(features, labels, mode, params):
  """Keras' documented minimize(loss_fn, var_list_fn), no-argument callables
  (the loss built again inside the optimizer's tape). params: 'ordered',
  the update after the reported loss."""
  hidden = tf.keras.layers.Dense(4, activation="relu", name="hidden")
  dense = tf.keras.layers.Dense(2, name="logits")

  def loss_fn():
    logits = dense(hidden(features["x"]))
    return tf.reduce_mean(
        tf.keras.losses.sparse_categorical_crossentropy(
            labels, logits, from_logits=True))

  loss = loss_fn()
  optimizer = tf.keras.optimizers.legacy.Adam(0.05)
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  # On one device nothing orders the reported loss's reads before the
  # update either: a loaded machine could report the next step's loss.
  with tf.control_dependencies([loss] if (params or {}).get("ordered") else []):
    train_op = optimizer.minimize(
        loss_fn, lambda: hidden.trainable_weights + dense.trainable_weights)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", ON_4)
def test_keras_minimize_of_callables(towers):
  _assert_trains_as_one_device(
      _keras_minimize_model_fn, _data(), 8, 5, towers, params={"ordered": True})


# Four replicated estimators trained first (tens of seconds): in the wide
# run; test_long_run checks every patch set is undone after each call.
@pytest.mark.wide
def test_an_unwrapped_baseline_trains_after_replicated_ones(tmp_path):
  """Nothing of one replicated graph leaks into the next (a one-shot
  iterator's initializer, a routed optimizer): four canned Baseline
  estimators replicated, then a plain one with its default optimizer."""
  x, y = _data(16)
  feature = {"x": x["x"][:, :1]}

  def input_fn(labels):
    return lambda: tf.compat.v1.data.Dataset.from_tensor_slices(
        (feature, labels)).repeat().batch(8)

  estimators = [
      (tf.estimator.BaselineClassifier(weight_column="w",
                                       optimizer="Ftrl"), y, {
                                           "w": np.ones(16, np.float32)
                                       }),
      (tf.estimator.BaselineRegressor(label_dimension=2),
       np.stack([y, y], 1).astype(np.float32), {}),
      (tf.estimator.BaselineRegressor(
          loss_reduction=tf.keras.losses.Reduction.SUM), y.astype(np.float32),
       {}),
      (tf.compat.v1.estimator.BaselineClassifier(), y, {}),
  ]
  for index, (canned, labels, extra) in enumerate(estimators):
    data = dict(feature, **extra)
    estimator = tf.estimator.Estimator(
        replicate.replicate_model_fn(
            canned.model_fn, devices=_towers(2 + 2 * (index % 2))),
        model_dir=str(tmp_path / str(index)),
        config=replicate.testing.run_config(4))
    estimator.train(
        lambda data=data, labels=labels: tf.compat.v1.data.Dataset.
        from_tensor_slices((data, labels)).repeat().batch(8),
        steps=2)
    estimator.evaluate(
        lambda data=data, labels=labels: tf.compat.v1.data.Dataset.
        from_tensor_slices((data, labels)).batch(8),
        steps=1)
    list(
        estimator.predict(lambda data=data: tf.compat.v1.data.Dataset.
                          from_tensor_slices(data).batch(8)))
  for optimizer in ("Ftrl", tf.keras.optimizers.legacy.Ftrl(0.1)):
    plain = tf.estimator.BaselineClassifier(
        optimizer=optimizer,
        model_dir=str(tmp_path / "plain" / str(id(optimizer))))
    plain.train(input_fn(y), steps=2)
    assert plain.get_variable_value("global_step") == 2


# -------------------------------------------------- meetings in a tf.cond

ACCUMULATE = 3


def _accumulating_model_fn(features, labels, mode, params):
  """OpenNMT-tf v1's gradient accumulation, written by hand: gradients
  every step, added to accumulators; every ACCUMULATE steps, inside a
  tf.cond, the accumulators are applied and zeroed."""
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.dense(
          features["x"], 4, activation=tf.nn.tanh, name="hidden"),
      2,
      name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = (
      tf.compat.v1.train.AdamOptimizer(0.05) if params["adam"] else _sgd())
  grads_and_vars = optimizer.compute_gradients(loss)
  accumulators = [
      tf.compat.v1.get_variable(
          v.op.name.replace("/", "_") + "_accum",
          v.shape,
          trainable=False,
          initializer=tf.zeros_initializer()) for _, v in grads_and_vars
  ]
  step = tf.compat.v1.train.get_global_step()
  accumulate = [
      a.assign_add(g) for a, (g, _) in zip(accumulators, grads_and_vars)
  ]

  def apply_and_zero():
    with tf.control_dependencies(accumulate):
      applied = optimizer.apply_gradients([
          (a.read_value() / ACCUMULATE, v)
          for a, (_, v) in zip(accumulators, grads_and_vars)
      ])
    with tf.control_dependencies([applied]):
      return tf.group(*[a.assign(tf.zeros_like(a)) for a in accumulators])

  with tf.control_dependencies(accumulate):
    update = tf.cond(
        tf.equal((step + 1) % ACCUMULATE, 0), apply_and_zero, tf.no_op)
  with tf.control_dependencies([update]):
    train_op = step.assign_add(1)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("adam,towers", _in_turns([False, True]))
def test_gradient_accumulation_in_a_tf_cond(towers, adam):
  _, values = _assert_trains_as_one_device(
      _accumulating_model_fn,
      _data(),
      8,
      2 * ACCUMULATE + 1,
      towers,
      params={"adam": adam})
  assert values["global_step"] == 2 * ACCUMULATE + 1


def _cond_minimize_model_fn(features, labels, mode, params):
  """minimize inside a tf.cond branch (every other step)."""
  del params
  logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  step = tf.compat.v1.train.get_global_step()

  def minimized():
    with tf.control_dependencies([_sgd().minimize(loss, step)]):
      return tf.identity(step.read_value())

  train_op = tf.cond(
      tf.equal(step % 2, 0), minimized, lambda: step.assign_add(1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", ON_4)
def test_minimize_inside_a_tf_cond(towers):
  _assert_trains_as_one_device(_cond_minimize_model_fn, _data(), 8, 4, towers)


# ----------------------------------------------- towers building different


def test_an_extra_layer_in_tower_0_is_an_error():

  def model_fn(features, labels, mode, params):
    del params
    x = features["x"]
    if replicate.current_tower() and replicate.current_tower().index == 0:
      x = tf.compat.v1.layers.dense(x, 5, name="extra")
    logits = tf.keras.layers.Dense(2, name="logits")(x)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return _spec(mode, loss)

  with pytest.raises(
      ValueError,
      match=r"Tower 0 creates variable "
      r"'extra/kernel' that tower 1, the first built, did not"):
    harness.train(model_fn, _data(), 8, 1, tower_devices=_towers(2))


def test_a_layer_width_drawn_per_call_is_an_error():
  widths = iter([3, 5, 7, 9])

  def model_fn(features, labels, mode, params):
    del params
    h = tf.keras.layers.Dense(next(widths), name="hidden")(features["x"])
    logits = tf.keras.layers.Dense(2, name="logits")(h)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return _spec(mode, loss)

  with pytest.raises(
      ValueError,
      match=r"Tower 0 asks for variable "
      r"'hidden/kernel' with shape \(5, 5\), but tower 1.*"
      r"created it with shape \(5, 3\)"):
    harness.train(model_fn, _data(), 8, 1, tower_devices=_towers(2))


def test_v1_layers_differing_in_a_later_tower_are_an_error():

  def model_fn(features, labels, mode, params):
    del params
    x = features["x"]
    if replicate.current_tower() and replicate.current_tower().index == 1:
      x = tf.compat.v1.layers.dense(x, 5, name="extra")
    logits = tf.compat.v1.layers.dense(x, 2, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return _spec(mode, loss)

  with pytest.raises(
      ValueError,
      match=r"Towers 0 and 1 built different "
      r"models: tower 1 computes rows with .* op "
      r"'tower_1/extra/"):
    harness.train(model_fn, _data(), 8, 1, tower_devices=_towers(2))


def test_params_that_cannot_be_copied_are_named():

  class Unpicklable:

    def __deepcopy__(self, memo):
      raise TypeError("cannot deep-copy a lock")

  def model_fn(features, labels, mode, params):
    del params
    logits = tf.compat.v1.layers.dense(features["x"], 2)
    return _spec(
        mode, tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits))

  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    x, y = _data(8)
    with pytest.raises(
        TypeError,
        match=r"params .*Unpicklable.* cannot be "
        r"deep-copied.*cannot deep-copy a lock"):
      replicate.replicate_model_fn(
          model_fn, devices=_towers(2))({
              "x": tf.constant(x["x"])
          },
                                        tf.constant(y),
                                        TRAIN,
                                        params={
                                            "lock": Unpicklable()
                                        })


def test_tf_gradients_through_batch_sum_reach_every_variable():
  # A tower built before tower 0 holds a stand-in for batch_sum's result:
  # the variables its loss reads through it still get gradients, as tower
  # 0's do (once, the call named every variable but tower 1's none).
  def model_fn(features, labels, mode, params):
    del params
    logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
    errors = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits)
    loss = replicate.batch_sum(tf.reduce_sum(errors))
    variables = tf.compat.v1.trainable_variables()
    train_op = _sgd().apply_gradients(
        zip(tf.gradients(loss, variables), variables),
        tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  for towers in TOWERS:
    _assert_trains_as_one_device(model_fn, _data(), 7, 3, towers, static=False)


def _summarised_model_fn(features, labels, mode, params):
  del params
  hidden = tf.compat.v1.layers.dense(features["x"], 4, name="hidden")
  logits = tf.compat.v1.layers.dense(hidden, 2, name="logits")
  tf.compat.v1.summary.histogram("activations", hidden)
  tf.compat.v1.summary.image(
      "rows", tf.reshape(hidden, [-1, 2, 2, 1]), max_outputs=5)
  tf.compat.v1.summary.scalar("first", hidden[0, 0])
  tf.compat.v1.summary.scalar("last", tf.gather(hidden, 0)[-1] + hidden[-1, 0])
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return _spec(mode, loss)


def _summaries(towers):
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(), 8)
    model_fn = _summarised_model_fn
    if towers > 1:
      model_fn = replicate.replicate_model_fn(model_fn, devices=_towers(towers))
    model_fn(features, labels, TRAIN, {})
    summary = tf.compat.v1.summary.merge_all()
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      harness.set_trainable_weights(session)
      values = tf.compat.v1.Summary.FromString(session.run(summary)).value
  return {v.tag: v for v in values}


@pytest.mark.parametrize("towers", ON_4)
def test_summaries_of_rows_and_of_picked_rows_are_the_whole_batchs(towers):
  expected, actual = _summaries(1), _summaries(towers)
  assert sorted(actual) == sorted(expected)
  assert expected["activations"].histo.num == 8 * 4
  for tag, value in expected.items():
    if value.HasField("histo"):
      for field in ("num", "sum", "sum_squares", "min", "max"):
        np.testing.assert_allclose(
            getattr(actual[tag].histo, field),
            getattr(value.histo, field),
            rtol=1e-5,
            err_msg=tag)
    elif value.HasField("image"):
      assert actual[tag].image.encoded_image_string == (
          value.image.encoded_image_string), tag
    else:
      np.testing.assert_allclose(
          actual[tag].simple_value, value.simple_value, rtol=1e-6, err_msg=tag)
  # Five images: more than tower 0's shard holds.
  assert len([t for t in expected if t.startswith("rows/image")]) == 5


@pytest.mark.parametrize("towers", ON_4)
def test_integer_rows_picked_by_position_are_refused_where_whole(towers):
  # Integer rows are positions and counts of the tower's own values far
  # more often than data (a ragged tensor's row splits): picked by position
  # they stay the tower's, and a loss built from one is refused, not wrong.
  def model_fn(features, labels, mode, params):
    del params
    logits = tf.compat.v1.layers.dense(features["x"], 2, name="logits")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return _spec(mode, loss + tf.cast(labels[0], tf.float32))

  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(), 8)
    replicated = replicate.replicate_model_fn(model_fn, devices=_towers(towers))
    with pytest.raises(ValueError, match="picks integer rows"):
      replicated(features, labels, TRAIN, {})


@pytest.mark.parametrize("towers", ON_4)
def test_every_read_of_a_variable_runs_before_its_update(towers):
  # Keras' minimize(loss_fn) builds the loss again inside its tape: the
  # loss the step reports reads the variables apart from the gradients'
  # forward pass. On one device those reads run when the step starts; in
  # every tower they must run before the update too, or a loaded machine
  # could report the next step's weights.
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(), 8)
    spec = replicate.replicate_model_fn(
        _keras_minimize_model_fn, devices=_towers(towers))(features, labels,
                                                           TRAIN, {})

  def ancestors(op):
    found, pending = set(), [op]
    while pending:
      current = pending.pop()
      if current not in found:
        found.add(current)
        pending.extend(t.op for t in current.inputs)
        pending.extend(current.control_inputs)
    return found

  updates = [
      op for op in graph.get_operations() if op.type.startswith("ResourceApply")
  ]
  # MIRRORED (--replicate-placement) applies the update on every device.
  mirrored = bool(graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES))
  assert len(updates) == 4 * (towers if mirrored else 1)
  reads = [op for op in ancestors(spec.loss.op) if op.type == "ReadVariableOp"]
  assert len(reads) == 4 * towers
  for update in updates:
    before = ancestors(update)
    for read in reads:
      if read.inputs[0].op is update.inputs[0].op:
        assert read in before, (read.name, update.name)
