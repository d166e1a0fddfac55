"""Gradients a model_fn takes itself (`tf.gradients`) are one device's.

The BERT-style model_fn re-implements google-research/bert's
`optimization.py` pattern: `tf.gradients(loss, tvars)`, a global-norm clip
that binds, an Adam-with-weight-decay optimizer subclass whose
`apply_gradients` creates its own m/v variables with `get_variable`, and
the global step assigned in the model_fn. Each case trains a few steps on
one device and on 2 and 4 towers from the same weights and data (batches
that do and do not divide by the towers, static and dynamic) and compares
the losses and every variable, slots included.
"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from tests import harness

Reduction = tf.compat.v1.losses.Reduction
NUM_IDS = 10
CLIP_NORM = 1.0
STEPS = 3


class AdamWeightDecay(tf.compat.v1.train.Optimizer):
  """Adam with decoupled weight decay, as BERT's optimization.py writes it."""

  def __init__(self,
               learning_rate,
               weight_decay_rate=0.01,
               beta_1=0.9,
               beta_2=0.999,
               epsilon=1e-6,
               name="AdamWeightDecayOptimizer"):
    super().__init__(False, name)
    self.learning_rate = tf.identity(learning_rate, name="learning_rate")
    self.weight_decay_rate = weight_decay_rate
    self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    assignments = []
    for grad, param in grads_and_vars:
      if grad is None:
        continue
      param_name = param.op.name
      m = tf.compat.v1.get_variable(
          param_name + "/adam_m",
          shape=param.shape.as_list(),
          dtype=tf.float32,
          trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      v = tf.compat.v1.get_variable(
          param_name + "/adam_v",
          shape=param.shape.as_list(),
          dtype=tf.float32,
          trainable=False,
          initializer=tf.compat.v1.zeros_initializer())
      next_m = (
          tf.multiply(self.beta_1, m) + tf.multiply(1.0 - self.beta_1, grad))
      next_v = (
          tf.multiply(self.beta_2, v) +
          tf.multiply(1.0 - self.beta_2, tf.square(grad)))
      update = next_m / (tf.sqrt(next_v) + self.epsilon)
      if "bias" not in param_name:
        update += self.weight_decay_rate * param
      assignments.extend([
          param.assign(param - self.learning_rate * update),
          m.assign(next_m),
          v.assign(next_v)
      ])
    return tf.group(*assignments, name=name)


def _data(batch, steps=STEPS):
  rng = np.random.RandomState(0)
  n = batch * steps
  ids = rng.randint(0, NUM_IDS, size=(n, 2)).astype(np.int64)
  x = (3.0 * rng.randn(n, 2)).astype(np.float32)
  y = rng.randint(0, 3, size=n).astype(np.int64)
  return {"ids": ids, "x": x}, y


def _logits(features):
  """BERT's classifier in small: a gathered embedding and a dense output."""
  table = tf.compat.v1.get_variable("word_embeddings", [NUM_IDS, 4])
  pooled = tf.reduce_mean(tf.gather(table, features["ids"]), axis=1)
  hidden = tf.concat([pooled, features["x"]], axis=1)
  weights = tf.compat.v1.get_variable("output_weights", [6, 3])
  bias = tf.compat.v1.get_variable("output_bias", [3])
  return tf.matmul(hidden, weights) + bias


def _per_example_loss(logits, labels):
  log_probs = tf.nn.log_softmax(logits, axis=-1)
  one_hot = tf.one_hot(labels, depth=3, dtype=tf.float32)
  return -tf.reduce_sum(one_hot * log_probs, axis=-1)


def _bert_model_fn(wrap_optimizer):
  """run_classifier.py's model_fn with optimization.create_optimizer."""

  def model_fn(features, labels, mode, params):
    del params
    loss = tf.reduce_mean(_per_example_loss(_logits(features), labels))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = AdamWeightDecay(tf.constant(0.1))
    if wrap_optimizer:
      optimizer = replicate.TowerOptimizer(optimizer)
    tvars = tf.compat.v1.trainable_variables()
    grads = tf.gradients(loss, tvars)
    grads, norm = tf.clip_by_global_norm(grads, clip_norm=CLIP_NORM)
    tf.compat.v1.add_to_collection("global_norm", norm)
    train_op = optimizer.apply_gradients(
        zip(grads, tvars), global_step=global_step)
    new_global_step = tf.identity(global_step + 1, name="step_update")
    train_op = tf.group(train_op, [global_step.assign(new_global_step)])
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def _train(model_fn,
           batch,
           num_towers=None,
           static=True,
           reduction=Reduction.SUM_BY_NONZERO_WEIGHTS):
  """Losses, every variable after training, and the first step's norms."""
  towers = None if num_towers is None else harness.devices(
      harness.VIRTUAL_CPUS, num_towers)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = harness.batches(_data(batch), batch, static)
    spec = harness.wrap(model_fn, towers, reduction)(features, labels,
                                                     harness.TRAIN, {})
    norms = tf.compat.v1.get_collection("global_norm")
    with tf.compat.v1.Session(config=harness.session_config()) as session:
      session.run([
          tf.compat.v1.global_variables_initializer(),
          tf.compat.v1.local_variables_initializer()
      ])
      harness.set_trainable_weights(session)
      first_norms = session.run(norms)
      losses = [
          session.run([spec.loss, spec.train_op])[0] for _ in range(STEPS)
      ]
      values = {
          v.op.name: session.run(v) for v in tf.compat.v1.global_variables()
      }
  return np.array(losses), values, first_norms


def _assert_same(actual, expected, rtol=1e-5, atol=1e-6):
  np.testing.assert_allclose(actual[0], expected[0], rtol=rtol, atol=atol)
  assert sorted(actual[1]) == sorted(expected[1])
  for name, value in expected[1].items():
    np.testing.assert_allclose(
        actual[1][name], value, rtol=rtol, atol=atol, err_msg=name)


# id: (num_towers, batch, static); the most telling first.
_SHAPES = {
    "4-dynamic": (4, 9, False),
    "4-uneven": (4, 9, True),
    "2-4+4": (2, 8, True),
    "2-dynamic": (2, 9, False),
    "4-4+4": (4, 8, True),
    "2-uneven": (2, 9, True),
}
# id: (num_towers, batch); 3 rows on 4 towers leave one a phantom row.
_PENALTY_SHAPES = {
    "4-phantom": (4, 3),
    "4-uneven": (4, 9),
    "2-uneven": (2, 9),
    "2-phantom": (2, 3),
}


def _some(cases, default):
  """Parameter sets of {id: values}: those of `default` in the default run,
  the others wide."""
  return [(pytest.param if key in default else harness.wide)(*values, id=key)
          for key, values in cases.items()]


def _in_turns(shapes, forms, name=lambda shape, form: f"{shape}-{form}"):
  """Parameter sets of every shape and form ({id: values} each): each form
  on one shape in the default run, the shapes in turn; the others wide."""
  cases = []
  for i, (form, form_values) in enumerate(forms.items()):
    for j, (shape, shape_values) in enumerate(shapes.items()):
      make = pytest.param if j == i % len(shapes) else harness.wide
      cases.append(make(*shape_values, *form_values, id=name(shape, form)))
  return cases


@pytest.mark.parametrize(
    "num_towers,batch,static,wrap_optimizer",
    _in_turns(_SHAPES, {
        "unwrapped": (False,),
        "TowerOptimizer": (True,)
    }))
def test_bert_style_gradients_equal_one_device(num_towers, batch, static,
                                               wrap_optimizer):
  model_fn = _bert_model_fn(wrap_optimizer)
  expected = _train(model_fn, batch, static=static)
  assert expected[2][0] > CLIP_NORM  # the clip binds
  actual = _train(model_fn, batch, num_towers, static)
  assert len(actual[1]) == 3 * 3 + 1  # variables, m, v, global step
  _assert_same(actual, expected)


def _plain_model_fn(features, labels, mode, params):
  """Plain gradient descent on gradients the model_fn takes itself."""
  del params
  loss = tf.reduce_mean(_per_example_loss(_logits(features), labels))
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.compat.v1.gradients(loss, tvars)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).apply_gradients(
      zip(grads, tvars), tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize(
    "num_towers,batch,static",
    _some({
        k: v for k, v in _SHAPES.items() if "4+4" not in k
    }, ["4-dynamic"]))
def test_plain_descent_with_own_gradients_equals_one_device(
    num_towers, batch, static):
  expected = _train(_plain_model_fn, batch, static=static)
  _assert_same(_train(_plain_model_fn, batch, num_towers, static), expected)


def _penalty_model_fn(of):
  """A loss plus a penalty on a gradient with respect to the inputs.

  `of`: "loss", the gradient of the scalar (mean) loss, the whole batch's,
  each tower getting its rows; "sum", of the sum of the examples' losses
  (a scalar summed over the towers whatever the loss reduction);
  "per_example", of each example's loss (a non-scalar `ys`, each tower's
  own).
  """

  def model_fn(features, labels, mode, params):
    del params
    features = dict(features, x=tf.identity(features["x"]))
    losses = _per_example_loss(_logits(features), labels)
    loss = tf.reduce_mean(losses)
    ys = {"loss": loss, "sum": tf.reduce_sum(losses), "per_example": losses}[of]
    input_grad, = tf.gradients(ys, [features["x"]])
    total = loss + 0.3 * tf.reduce_mean(
        tf.reduce_sum(tf.square(input_grad), axis=1))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
        total, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=total, train_op=train_op)

  return model_fn


@pytest.mark.parametrize(
    "num_towers,batch,of",
    _in_turns(
        _PENALTY_SHAPES, {
            "loss": ("loss",),
            "sum": ("sum",),
            "per_example": ("per_example",)
        },
        name=lambda shape, form: shape.replace("-", f"-{form}-")))
def test_gradient_penalty_on_inputs_equals_one_device(num_towers, of, batch):
  # With 4 towers a batch of 3 leaves one tower a phantom row: its inputs'
  # gradient is zeros, and nothing of it reaches the result.
  model_fn = _penalty_model_fn(of)
  expected = _train(model_fn, batch)
  _assert_same(_train(model_fn, batch, num_towers), expected)


def _saliency_model_fn(features, labels, mode, params):
  """Predicts the gradient of the first logits' sum with respect to `x`."""
  del labels, params
  features = dict(features, x=tf.identity(features["x"]))
  logits = _logits(features)
  saliency, = tf.gradients(tf.reduce_sum(logits[:, 0]), [features["x"]])
  return tf.estimator.EstimatorSpec(
      mode, predictions={
          "saliency": saliency,
          "logits": logits
      })


@pytest.mark.parametrize("num_towers,batch,static",
                         _some(_SHAPES, ["4-dynamic", "2-uneven"]))
def test_saliency_in_predict_equals_one_device(num_towers, batch, static):
  features = _data(batch, steps=1)[0]
  expected = harness.predict(
      _saliency_model_fn, features, batch, 1, static=static)
  actual = harness.predict(
      _saliency_model_fn,
      features,
      batch,
      1,
      harness.devices(harness.VIRTUAL_CPUS, num_towers),
      static=static)
  harness.assert_close_nests(actual, expected, rtol=1e-5, atol=1e-6)


def _sum_model_fn(grad_ys):
  """A summed loss; gradients with `grad_ys` are each tower's share."""

  def model_fn(features, labels, mode, params):
    del params
    loss = tf.reduce_sum(_per_example_loss(_logits(features), labels))
    tvars = tf.compat.v1.trainable_variables()
    grads = tf.gradients(
        loss, tvars, grad_ys=tf.constant(1.0) if grad_ys else None)
    grads, _ = tf.clip_by_global_norm(grads, 100.0)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(
        0.05).apply_gradients(
            zip(grads, tvars), tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize(
    "num_towers,grad_ys",
    _in_turns({
        "4": (4,),
        "2": (2,)
    }, {
        "whole_batch": (False,),
        "shares_summed": (True,)
    }))
def test_sum_reduction_equals_one_device(num_towers, grad_ys):
  model_fn = _sum_model_fn(grad_ys)
  expected = _train(model_fn, 9, reduction=Reduction.SUM)
  actual = _train(model_fn, 9, num_towers, reduction=Reduction.SUM)
  _assert_same(actual, expected)


def _descent_model_fn(gradients):
  """Plain descent on `gradients(tape, loss, tvars)`, the loss taken under a
  GradientTape."""

  def model_fn(features, labels, mode, params):
    del params
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_per_example_loss(_logits(features), labels))
    tvars = tf.compat.v1.trainable_variables()
    grads = gradients(tape, loss, tvars)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).apply_gradients(
        zip(grads, tvars), tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize("num_towers", [harness.wide(2, id="2"), 4])
def test_gradients_with_grad_ys_equal_one_devices(num_towers):
  # grad_ys scales what is differentiated: one device's loss, once.
  model_fn = _descent_model_fn(lambda tape, loss, tvars: tf.gradients(
      loss, tvars, grad_ys=tf.constant(0.5)))
  _assert_same(_train(model_fn, 8, num_towers), _train(model_fn, 8))


def test_gradients_in_one_tower_only_are_an_error():

  def model_fn(features, labels, mode, params):
    del params
    loss = tf.reduce_mean(_per_example_loss(_logits(features), labels))
    tvars = tf.compat.v1.trainable_variables()
    if replicate.current_tower().index == 0:
      norm = tf.linalg.global_norm(tf.gradients(loss, tvars))
      tf.compat.v1.summary.scalar("gradient_norm", norm)
    grads = tf.gradients(loss, tvars)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).apply_gradients(
        zip(grads, tvars), tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  with pytest.raises(
      ValueError,
      match=r"different calls.*tower 1 is "
      r".*apply_gradients.*tower 0's is tf.gradients"):
    _train(model_fn, 8, 2)


def _public_gradients():
  """What user code calls: tf.gradients, tf.compat.v1.gradients (also what
  `import tensorflow.compat.v1 as tf` gives), and the compat.v1 of
  tensorflow.compat.v2 that Keras' backend.gradients calls."""
  return (tf.gradients, tf.compat.v1.gradients, tf.compat.v2.gradients,
          tf.compat.v2.compat.v1.gradients)


def test_public_gradients_are_routed_in_towers_then_restored():
  originals = _public_gradients()
  seen = []

  def model_fn(features, labels, mode, params):
    seen.append([f is o for f, o in zip(_public_gradients(), originals)])
    return _plain_model_fn(features, labels, mode, params)

  _train(model_fn, 8, 2)
  assert seen == [[False] * 4] * 2  # routed in both towers
  assert all(f is o for f, o in zip(_public_gradients(), originals))


def _tape_model_fn(optimizer):
  """TF2 style: the loss under a GradientTape, its gradient clipped and
  applied by a v1 or a Keras optimizer."""

  def model_fn(features, labels, mode, params):
    del params
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_per_example_loss(_logits(features), labels))
    tvars = tf.compat.v1.trainable_variables()
    grads = tape.gradient(loss, tvars)
    grads, norm = tf.clip_by_global_norm(grads, clip_norm=CLIP_NORM)
    tf.compat.v1.add_to_collection("global_norm", norm)
    step = tf.compat.v1.train.get_global_step()
    if optimizer == "v1":
      train_op = tf.compat.v1.train.AdamOptimizer(0.1).apply_gradients(
          zip(grads, tvars), step)
    else:
      train_op = tf.keras.optimizers.legacy.Adam(0.1).apply_gradients(
          zip(grads, tvars))
      with tf.control_dependencies([train_op]):
        train_op = step.assign_add(1)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


@pytest.mark.parametrize(
    "num_towers,batch,static,optimizer",
    _in_turns(_SHAPES, {
        "v1": ("v1",),
        "keras": ("keras",)
    }))
def test_gradient_tape_gradients_equal_one_device(num_towers, batch, static,
                                                  optimizer):
  model_fn = _tape_model_fn(optimizer)
  expected = _train(model_fn, batch, static=static)
  assert expected[2][0] > CLIP_NORM  # the clip binds
  _assert_same(_train(model_fn, batch, num_towers, static), expected)


def _tape_penalty_model_fn(features, labels, mode, params):
  """A penalty on the loss's gradient with respect to the inputs, both
  taken with tapes (the inner one watching the inputs); a variable read
  outside the tapes gets no gradient, as from the tape."""
  del params
  unwatched = tf.compat.v1.get_variable("unwatched", [3])
  offset = unwatched.read_value()
  with tf.GradientTape() as outer:
    x = tf.identity(features["x"])
    with tf.GradientTape() as inner:
      inner.watch(x)
      losses = _per_example_loss(_logits(dict(features, x=x)) + offset, labels)
      loss = tf.reduce_mean(losses)
    input_grad = inner.gradient(loss, x)
    total = loss + 0.3 * tf.reduce_mean(
        tf.reduce_sum(tf.square(input_grad), axis=1))
  tvars = tf.compat.v1.trainable_variables()
  grads = outer.gradient(total, tvars)
  assert grads[tvars.index(unwatched)] is None
  pairs = [(g, v) for g, v in zip(grads, tvars) if g is not None]
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).apply_gradients(
      pairs, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=total, train_op=train_op)


@pytest.mark.parametrize("num_towers,batch",
                         _some(_PENALTY_SHAPES, ["4-phantom"]))
def test_gradient_tape_penalty_on_inputs_equals_one_device(num_towers, batch):
  expected = _train(_tape_penalty_model_fn, batch)
  _assert_same(_train(_tape_penalty_model_fn, batch, num_towers), expected)


def test_gradient_tape_is_routed_in_towers_then_restored():
  original = tf.GradientTape.gradient
  seen = []

  def model_fn(features, labels, mode, params):
    seen.append(tf.GradientTape.gradient is original)
    return _tape_model_fn("v1")(features, labels, mode, params)

  _train(model_fn, 8, 2)
  assert seen == [False, False]
  assert tf.GradientTape.gradient is original


def test_tape_gradients_with_output_gradients_equal_one_devices():
  model_fn = _descent_model_fn(lambda tape, loss, tvars: tape.gradient(
      loss, tvars, output_gradients=tf.constant(2.0)))
  _assert_same(_train(model_fn, 8, 2), _train(model_fn, 8))
