"""Real libraries' model_fns, as shipped, replicated as one device.

Each library builds its Estimator model_fn from graph state a call reads:
DeepCTR's weight penalties in REGULARIZATION_LOSSES, TF-GAN's scoped
`get_regularization_loss('Discriminator')`, a TF1 Hub module's variable and
name scopes, AdaNet's moving averages of tensors and its variables picked
by a marker, the CIFAR-10 tutorial's 'losses' collection and moving
averages, TF Addons' losses over the batch's pairs (some in a `tf.function`)
and Keras metric subclasses, Neural Structured Learning's second call of
the model_fn on perturbed inputs, TF Privacy's clipped microbatches. Wrapped
with the README's one line (NSL: its wrapper around the replicated
Estimator, as its documentation wraps any Estimator), each trains, and
where the library evaluates and predicts, does so, on 2, 3 and 4 towers
(uneven batches of 9 rows) as on one device from the same checkpoint
(`replicate.testing.assert_replicates`). The default run keeps one case of
each library but AdaNet; the other cases, AdaNet's among them, are `wide`.

AdaNet and TF Privacy are installed without their dependencies (README):
their own pins predate TensorFlow 2.13 or name the full `tensorflow` wheel.
A test is skipped where its library is not installed.
"""

import collections
import inspect
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

import replicate
import replicate.testing
from tests import harness

BATCH = 9
TOWERS = (2, 4)
ROWS = 45


def _dataset(features, labels=None):

  def input_fn():
    data = features if labels is None else (features, labels)
    return tf.data.Dataset.from_tensor_slices(data).repeat().batch(BATCH)

  return input_fn


# ------------------------------------------------------------------ DeepCTR


def _ctr_data():
  rng = np.random.RandomState(0)
  features = {
      "c1": rng.randint(0, 5, ROWS).astype(np.int64),
      "c2": rng.randint(0, 7, ROWS).astype(np.int64),
      "d1": rng.randn(ROWS).astype(np.float32),
  }
  return features, rng.randint(0, 2, ROWS).astype(np.float32)


def _ctr_columns():
  fc = tf.feature_column
  ids = [
      fc.categorical_column_with_identity("c1", 5),
      fc.categorical_column_with_identity("c2", 7)
  ]
  dense = fc.numeric_column("d1")
  linear = [fc.indicator_column(c) for c in ids] + [dense]
  dnn = [fc.embedding_column(c, 4) for c in ids] + [dense]
  return linear, dnn


# DeepFM on 2 towers; on 4, and the other two (the same penalties through
# the same DeepCTR code, other networks) on one count each, in the wide run.
@pytest.mark.parametrize("name,towers",
                         [("DeepFMEstimator", TOWERS[:1]),
                          harness.wide("DeepFMEstimator", TOWERS[1:]),
                          harness.wide("DCNEstimator", TOWERS[1:]),
                          harness.wide("WDLEstimator", TOWERS[:1])])
def test_deepctr_with_weight_penalties_replicates(name, towers):
  estimator_module = pytest.importorskip("deepctr.estimator")
  linear, dnn = _ctr_columns()
  penalties = dict(l2_reg_linear=0.1, l2_reg_embedding=0.1, l2_reg_dnn=0.1)
  if name == "DCNEstimator":
    penalties["l2_reg_cross"] = 0.1
  estimator = getattr(estimator_module, name)(
      linear, dnn, dnn_hidden_units=(8,), **penalties)
  summary = replicate.testing.assert_replicates(
      estimator.model_fn, _dataset(*_ctr_data()), towers=towers)
  assert summary.variables > 10
  assert "AUC" in summary.metrics


# ------------------------------------------------------------------ TF-GAN


def _tfgan():
  # TF-GAN 2.1.0 calls inspect.getargspec, which Python 3.11 removed; the
  # unreplicated GANEstimator fails without this too.
  if not hasattr(inspect, "getargspec"):
    spec = collections.namedtuple("ArgSpec", "args varargs keywords defaults")

    def getargspec(fn):
      full = inspect.getfullargspec(fn)
      return spec(full.args, full.varargs, full.varkw, full.defaults)

    inspect.getargspec = getargspec
  return pytest.importorskip("tensorflow_gan")


def _generator(noise):
  return tf.compat.v1.layers.dense(noise, 4, name="g1")


def _discriminator(data, unused_conditioning):
  regularizer = tf.keras.regularizers.l2(0.5)
  hidden = tf.compat.v1.layers.dense(
      data, 5, tf.nn.tanh, name="d1", kernel_regularizer=regularizer)
  return tf.compat.v1.layers.dense(hidden, 1, name="d2")


def test_tfgan_with_a_scoped_regularizer_replicates():
  tfgan = _tfgan()
  rng = np.random.RandomState(1)
  noise = rng.randn(ROWS, 3).astype(np.float32)
  real = rng.randn(ROWS, 4).astype(np.float32)
  estimator = tfgan.estimator.GANEstimator(
      generator_fn=_generator,
      discriminator_fn=_discriminator,
      generator_loss_fn=tfgan.losses.wasserstein_generator_loss,
      discriminator_loss_fn=tfgan.losses.wasserstein_discriminator_loss,
      generator_optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
      discriminator_optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
  summary = replicate.testing.assert_replicates(
      estimator.model_fn,
      _dataset(noise, real),
      towers=TOWERS,
      params=estimator.params,
      predict_input_fn=_dataset(noise),
      rtol=1e-5)
  assert "discriminator_loss" in summary.metrics


# ------------------------------------------------------------------ TF Hub


def _hub_spec(hub):

  def module_fn():
    sentences = tf.compat.v1.placeholder(tf.string, [None])
    buckets = tf.strings.to_hash_bucket_fast(sentences, 16)
    table = tf.compat.v1.get_variable("embeddings", [16, 3])
    hub.add_signature(inputs=sentences, outputs=tf.gather(table, buckets))

  return hub.create_module_spec(module_fn)


def test_hub_module_in_a_model_fn_replicates():
  hub = pytest.importorskip("tensorflow_hub")
  spec = _hub_spec(hub)

  def model_fn(features, labels, mode):
    module = hub.Module(spec, trainable=True)
    hidden = module(features["text"])
    logits = tf.compat.v1.layers.dense(hidden, 3, name="logits")
    if mode == tf.estimator.ModeKeys.PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  summary = replicate.testing.assert_replicates(
      model_fn, _dataset(*_texts()), towers=TOWERS)
  assert summary.variables == 4  # the module's table, the logits, the step


def _texts():
  rng = np.random.RandomState(2)
  words = np.array(["a", "b c", "d e f", "g", "h i", "j k l m"])
  return ({
      "text": words[rng.randint(0, len(words), ROWS)]
  }, rng.randint(0, 3, ROWS).astype(np.int64))


def _hub_text_spec(hub):
  """As TF Hub's text modules embed: sentences split into words, each
  word's embedding looked up and combined per sentence."""

  def module_fn():
    sentences = tf.compat.v1.placeholder(tf.string, [None])
    words = tf.compat.v1.string_split(sentences)
    ids = tf.SparseTensor(words.indices,
                          tf.strings.to_hash_bucket_fast(words.values, 16),
                          words.dense_shape)
    table = tf.compat.v1.get_variable("embeddings", [16, 3])
    hub.add_signature(
        inputs=sentences,
        outputs=tf.nn.embedding_lookup_sparse(
            table, ids, None, combiner="sqrtn"))

  return hub.create_module_spec(module_fn)


@pytest.mark.parametrize("towers,batch", [(2, 9), harness.wide(4, 10)])
def test_hub_text_embedding_column_in_a_canned_estimator_replicates(
    towers, batch):
  hub = pytest.importorskip("tensorflow_hub")
  column = hub.text_embedding_column(
      "text", _hub_text_spec(hub), trainable=True)
  canned = tf.compat.v1.estimator.DNNClassifier(
      hidden_units=[4],
      feature_columns=[column],
      n_classes=3,
      optimizer=tf.compat.v1.train.AdagradOptimizer(0.1))
  texts = _texts()

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(texts).repeat().batch(batch)

  summary = replicate.testing.assert_replicates(
      canned.model_fn, input_fn, towers=(towers,))
  assert "accuracy" in summary.metrics


# ------------------------------------------------------------------ AdaNet


def _adanet():
  # AdaNet 0.9.0 imports tensorflow.python.training.tracking.graph_view,
  # which TensorFlow 2.11 moved; the unreplicated Estimator needs this too.
  if "tensorflow.python.training.tracking" not in sys.modules:
    from tensorflow.python.checkpoint import graph_view  # pylint: disable=g-import-not-at-top,g-direct-tensorflow-import
    tracking = types.ModuleType("tensorflow.python.training.tracking")
    tracking.graph_view = graph_view
    sys.modules["tensorflow.python.training.tracking"] = tracking
    sys.modules["tensorflow.python.training.tracking.graph_view"] = graph_view
  return pytest.importorskip("adanet")


def _adanet_estimators(adanet, devices, model_dir):
  """AdaNet's Estimator, and the same replicated (the route docs name)."""

  class Builder(adanet.subnetwork.Builder):

    def __init__(self, size):
      self._size = size

    def build_subnetwork(self,
                         features,
                         logits_dimension,
                         training,
                         iteration_step,
                         summary,
                         previous_ensemble=None):
      seeded = tf.compat.v1.glorot_uniform_initializer
      hidden = tf.compat.v1.layers.dense(
          features["x"],
          self._size,
          tf.nn.tanh,
          kernel_initializer=seeded(seed=self._size))
      logits = tf.compat.v1.layers.dense(
          hidden, logits_dimension, kernel_initializer=seeded(seed=9))
      return adanet.Subnetwork(
          last_layer=hidden,
          logits=logits,
          complexity=tf.constant(float(self._size)),
          persisted_tensors={})

    def build_subnetwork_train_op(self, subnetwork, loss, var_list, labels,
                                  iteration_step, summary, previous_ensemble):
      return tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
          loss, var_list=var_list)

    @property
    def name(self):
      return f"dnn_{self._size}"

  class Generator(adanet.subnetwork.Generator):

    def generate_candidates(self, previous_ensemble, iteration_number,
                            previous_ensemble_reports, all_reports):
      return [Builder(3), Builder(4)]

  class Replicated(adanet.Estimator):

    def _create_model_fn(self, *args, **kwargs):
      return replicate.replicate_model_fn(
          super()._create_model_fn(*args, **kwargs), devices=devices)

  def build(estimator_class, directory):
    return estimator_class(
        head=tf.estimator.MultiClassHead(3),
        subnetwork_generator=Generator(),
        max_iteration_steps=3,
        config=replicate.testing.run_config(
            4, model_dir=str(directory), tf_random_seed=0))

  return (build(adanet.Estimator,
                model_dir / "one"), build(Replicated, model_dir / "towers"))


def _adanet_run(estimator):
  """Two AdaNet iterations (training, choosing the best ensemble, growing),
  then the trained variables and an evaluation."""
  rng = np.random.RandomState(3)
  data = _dataset({"x": rng.randn(ROWS, 5).astype(np.float32)},
                  rng.randint(0, 3, ROWS).astype(np.int64))
  estimator.train(data, max_steps=6)
  values = {
      name: estimator.get_variable_value(name)
      for name in estimator.get_variable_names()
  }
  return estimator.evaluate(data, steps=3), values


@pytest.fixture(scope="module")
def adanet_one_device(tmp_path_factory):
  adanet = _adanet()
  one, _ = _adanet_estimators(adanet, ["/device:CPU:0"],
                              tmp_path_factory.mktemp("adanet"))
  return _adanet_run(one)


# AdaNet's two iterations take tens of seconds a run: the wide run has them.
# The default run has its pattern (moving averages of tensors a tower
# computes) in test_drawn_graph_state and test_graph_views.
@pytest.mark.parametrize("num_towers", [harness.wide(n) for n in TOWERS])
def test_adanet_estimator_trains_replicated_through_its_model_fn(
    num_towers, tmp_path, adanet_one_device):
  adanet = _adanet()
  devices = [f"/device:CPU:{i}" for i in range(num_towers)]
  _, replicated = _adanet_estimators(adanet, devices, tmp_path)
  towers_metrics, towers_values = _adanet_run(replicated)
  metrics, values = adanet_one_device
  assert sorted(towers_values) == sorted(values)
  for name, value in values.items():
    np.testing.assert_allclose(towers_values[name], value, 1e-5, 1e-6, name)
  for name in ("loss", "accuracy", "iteration"):
    np.testing.assert_allclose(towers_metrics[name], metrics[name], 1e-5, 1e-6,
                               name)


# ------------------------------------------------- the CIFAR-10 tutorial


def _weight_decayed(name, shape, stddev, decay):
  variable = tf.compat.v1.get_variable(
      name,
      shape,
      initializer=tf.compat.v1.truncated_normal_initializer(stddev=stddev))
  if decay is not None:
    tf.compat.v1.add_to_collection(
        "losses",
        tf.multiply(tf.nn.l2_loss(variable), decay, name="weight_loss"))
  return variable


def _cifar_inference(images):
  with tf.compat.v1.variable_scope("conv1") as scope:
    kernel = _weight_decayed("weights", [3, 3, 2, 4], 5e-2, 0.01)
    biases = tf.compat.v1.get_variable(
        "biases", [4], initializer=tf.constant_initializer())
    conv = tf.nn.conv2d(images, kernel, [1, 1, 1, 1], padding="SAME")
    conv1 = tf.nn.relu(tf.nn.bias_add(conv, biases), name=scope.name)
  pool1 = tf.nn.max_pool2d(conv1, 2, 2, padding="SAME", name="pool1")
  with tf.compat.v1.variable_scope("local3") as scope:
    reshape = tf.reshape(pool1, [tf.shape(images)[0], -1])
    weights = _weight_decayed("weights", [36, 8], 0.04, 0.004)
    biases = tf.compat.v1.get_variable(
        "biases", [8], initializer=tf.constant_initializer(0.1))
    local3 = tf.nn.relu(tf.matmul(reshape, weights) + biases, name=scope.name)
  with tf.compat.v1.variable_scope("softmax_linear") as scope:
    weights = _weight_decayed("weights", [8, 3], 1 / 8.0, None)
    biases = tf.compat.v1.get_variable(
        "biases", [3], initializer=tf.constant_initializer())
    return tf.add(tf.matmul(local3, weights), biases, name=scope.name)


def _cifar_model_fn(features, labels, mode):
  """tensorflow/models' tutorials/image/cifar10/cifar10.py, as a model_fn."""
  logits = _cifar_inference(features)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  cross_entropy = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=labels, logits=logits),
      name="cross_entropy")
  tf.compat.v1.add_to_collection("losses", cross_entropy)
  total_loss = tf.add_n(
      tf.compat.v1.get_collection("losses"), name="total_loss")
  averages = tf.compat.v1.train.ExponentialMovingAverage(0.9, name="avg")
  losses = tf.compat.v1.get_collection("losses")
  averages_op = averages.apply(losses + [total_loss])
  for loss in losses + [total_loss]:
    tf.compat.v1.summary.scalar(loss.op.name + " (raw)", loss)
    tf.compat.v1.summary.scalar(loss.op.name, averages.average(loss))
  step = tf.compat.v1.train.get_global_step()
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
  with tf.control_dependencies([averages_op]):
    gradients = optimizer.compute_gradients(total_loss)
  apply_op = optimizer.apply_gradients(gradients, global_step=step)
  variable_averages = tf.compat.v1.train.ExponentialMovingAverage(0.9999, step)
  with tf.control_dependencies([apply_op]):
    train_op = variable_averages.apply(tf.compat.v1.trainable_variables())
  return tf.estimator.EstimatorSpec(
      mode,
      loss=total_loss,
      train_op=train_op,
      eval_metric_ops={
          "accuracy":
              tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))
      })


@pytest.mark.parametrize("placement", [harness.wide("shared"), "mirrored"])
def test_cifar10_tutorial_model_replicates(placement):
  rng = np.random.RandomState(4)
  images = rng.randn(ROWS, 6, 6, 2).astype(np.float32)
  labels = rng.randint(0, 3, ROWS).astype(np.int64)
  summary = replicate.testing.assert_replicates(
      _cifar_model_fn,
      _dataset(images, labels),
      towers=TOWERS,
      variable_placement=placement)
  # Five weights and biases, their moving averages, the losses' averages
  # (two weight decays, the cross entropy, the total) and the step.
  assert summary.variables == 6 + 6 + 4 + 1


# ------------------------------------------------------------ TF Addons


def _tfa():
  return pytest.importorskip(
      "tensorflow_addons",
      reason="TF Addons 0.23, its last release, installs on Python 3.9-3.11 "
      "and TensorFlow 2.13-2.15 only")


def _embedding_data():
  rng = np.random.RandomState(5)
  return ({
      "x": rng.randn(ROWS, 5).astype(np.float32)
  }, rng.randint(0, 3, ROWS).astype(np.int64))


def _tfa_model_fn(features, labels, mode):
  """Metric learning as TF Addons writes it: losses over the batch's pairs
  (hard and semi-hard triplets, N-pairs), some built in a `tf.function`,
  and Keras metric subclasses (F1, Cohen's kappa) in evaluation."""
  tfa = _tfa()
  hidden = tf.compat.v1.layers.dense(features["x"], 4, name="embed")
  embeddings = tf.math.l2_normalize(hidden, axis=1)
  logits = tf.compat.v1.layers.dense(hidden, 3, name="logits")
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
  loss = (
      tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits) +
      tfa.losses.TripletHardLoss(soft=True)(labels, embeddings) +
      tfa.losses.triplet_semihard_loss(labels, embeddings) +
      tfa.losses.npairs_loss(
          labels, tf.matmul(embeddings, embeddings, transpose_b=True)))
  if mode == tf.estimator.ModeKeys.EVAL:
    f1 = tfa.metrics.F1Score(3, average="macro")
    f1.update_state(tf.one_hot(labels, 3), tf.nn.softmax(logits))
    kappa = tfa.metrics.CohenKappa(3, sparse_labels=True)
    kappa.update_state(labels, tf.argmax(logits, 1))
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, eval_metric_ops={
            "f1": f1,
            "kappa": kappa
        })
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("towers", [TOWERS[:1], harness.wide(TOWERS[1:])])
def test_tfa_pair_losses_and_metric_subclasses_replicate(towers):
  _tfa()
  summary = replicate.testing.assert_replicates(
      _tfa_model_fn, _dataset(*_embedding_data()), towers=towers)
  assert {"f1", "kappa", "loss"} <= set(summary.metrics)


# ------------------------------------------ Neural Structured Learning


def _nsl():
  return pytest.importorskip("neural_structured_learning")


def _adversarial(nsl, model_fn, model_dir):
  """NSL's adversarial regularization around an Estimator of `model_fn`:
  the model_fn called again on the inputs its loss's gradient perturbs."""
  estimator = tf.estimator.Estimator(model_fn, model_dir=str(model_dir))
  config = nsl.configs.make_adv_reg_config(multiplier=0.5, adv_step_size=0.1)
  regularized = nsl.estimator.add_adversarial_regularization(
      estimator,
      adv_config=config,
      optimizer_fn=lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5))
  # The Estimator's own call, without a RunConfig (harness passes params).
  return lambda features, labels, mode, params: regularized.model_fn(
      features, labels, mode, None)


def _dense_model_fn(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(features["x"], 4, tf.nn.tanh, name="h")
  logits = tf.compat.v1.layers.dense(hidden, 3, name="logits")
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _canned_dnn_model_fn():
  column = tf.feature_column.numeric_column("x", [5])
  return tf.compat.v1.estimator.DNNClassifier([4], [column],
                                              n_classes=3).model_fn


@pytest.mark.parametrize("name,towers", [("custom", 2), ("canned", 3),
                                         harness.wide("custom", 4),
                                         harness.wide("canned", 2)])
def test_nsl_adversarial_regularization_of_a_replicated_estimator(
    name, towers, tmp_path):
  """NSL wraps the Estimator of the replicated model_fn (its documented
  use): each call's towers, the perturbation by the whole batch's
  gradient, then one update of the sum."""
  nsl = _nsl()
  model_fn = _dense_model_fn if name == "custom" else _canned_dnn_model_fn()
  features, labels = _embedding_data()
  one = harness.train(
      _adversarial(nsl, model_fn, tmp_path / "one"), (features, labels),
      BATCH,
      steps=3,
      static=False)
  replicated = replicate.replicate_model_fn(
      model_fn, devices=harness.devices(harness.VIRTUAL_CPUS, towers))
  many = harness.train(
      _adversarial(nsl, replicated, tmp_path / "towers"), (features, labels),
      BATCH,
      steps=3,
      static=False)
  np.testing.assert_allclose(many[0], one[0], rtol=1e-5)
  assert sorted(many[1]) == sorted(one[1])
  harness.assert_close_nests(many[1], one[1])


def test_nsl_adversarial_model_fn_replicated_inside():
  """The same wrapper's model_fn, replicated as a whole."""
  nsl = _nsl()
  estimator = tf.estimator.Estimator(_dense_model_fn)
  model_fn = nsl.estimator.add_adversarial_regularization(
      estimator,
      optimizer_fn=lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5)
  ).model_fn
  summary = replicate.testing.assert_replicates(
      model_fn,
      _dataset(*_embedding_data()),
      towers=TOWERS[:1],
      modes=["train"])
  assert summary.variables == 5


# ------------------------------------------------------------ TF Privacy


def _dp_model_fn(features, labels, mode, params):
  """A DP-SGD model_fn as TF Privacy's tutorials write it: a vector loss
  whose microbatches' gradients are clipped one by one (no noise, so the
  run is deterministic; the clipping is active)."""
  dp_optimizer = pytest.importorskip(
      "tensorflow_privacy.privacy.optimizers.dp_optimizer",
      reason="TF Privacy 0.9.0 installs on Python 3.9-3.11 only")
  logits = tf.compat.v1.layers.dense(features["x"], 3, name="logits")
  vector_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  loss = tf.reduce_mean(vector_loss)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  optimizer = dp_optimizer.DPGradientDescentGaussianOptimizer(
      l2_norm_clip=0.3,
      noise_multiplier=0.0,
      num_microbatches=params["microbatches"],
      learning_rate=0.5)
  train_op = optimizer.minimize(
      vector_loss, global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize("microbatches,towers", [(3, 2), harness.wide(9, 4)])
def test_tf_privacy_dp_sgd_microbatches_replicate(microbatches, towers):
  features, labels = _embedding_data()
  summary = replicate.testing.assert_replicates(
      _dp_model_fn,
      _dataset(features, labels),
      towers=(towers,),
      params={"microbatches": microbatches},
      modes=["train", "eval"])
  assert summary.variables == 3
