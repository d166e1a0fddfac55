"""`_merge.state_compare.difference` on small graphs: the two rule sets.

Towers' values are built twice in one graph, as two towers build them; the
strict walk must prove them one value, the lenient one must name what
differs and nothing else. No Estimator: a graph per case, in milliseconds.
"""

import tensorflow as tf

from replicate import _graph
from replicate._merge import state_compare


def _pair(build):
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
    v = tf.compat.v1.get_variable("v", [3], use_resource=True)
    return build(x, v, 0), build(x, v, 1)


def _difference(a, b, strict, budget=64):
  return state_compare.difference(a, b, [budget], strict)


def test_values_built_alike_are_one_value_in_both_walks():
  a, b = _pair(lambda x, v, i: tf.reduce_mean(x * v.read_value(), 0) + 1.0)
  assert _difference(a, b, strict=True) is None
  assert _difference(a, b, strict=False) is None


def test_a_different_constant_is_named_by_both_walks():
  a, b = _pair(lambda x, v, i: tf.reduce_sum(x, 0) * float(2 + i))
  assert "is 2.0" in _difference(a, b, strict=False)
  assert _difference(a, b, strict=True) is not None


def test_nan_constants_are_equal_when_reporting():
  a, b = _pair(lambda x, v, i: tf.reduce_sum(x, 0) + float("nan"))
  assert _difference(a, b, strict=False) is None


def test_different_ops_are_named():
  a, b = _pair(lambda x, v, i: (tf.reduce_sum, tf.reduce_max)[i](x, 0))
  found = _difference(a, b, strict=False)
  assert "is Sum" in found and "is Max" in found


def test_identities_pass_only_when_reporting():

  def size(x, v, i):
    value = tf.cast(tf.shape(x)[0], tf.float32)
    return tf.identity(value) if i else value

  a, b = _pair(size)
  assert _difference(a, b, strict=False) is None
  assert _difference(
      a, b, strict=True) == (f"{a.op.name} is Cast, "
                             f"{b.op.name} is Identity")


def test_shape_reads_are_alike_when_reporting():
  # Two towers' shapes of different placeholders: by now a size read as a
  # value is the whole batch's, so the reporting walk stops there.
  graph = tf.Graph()
  with graph.as_default():
    x0 = tf.compat.v1.placeholder(tf.float32, [None, 3])
    x1 = tf.compat.v1.placeholder(tf.float32, [None, 4])
    a, b = (tf.cast(tf.shape(x)[0], tf.float32) for x in (x0, x1))
  assert _difference(a, b, strict=False) is None
  assert _difference(a, b, strict=True) is not None


def test_a_stateful_op_is_a_difference_only_when_proving():
  a, b = _pair(lambda x, v, i: tf.reduce_sum(x, 0) + tf.random.uniform([3]))
  assert _difference(
      a, b, strict=True) == (f"{a.op.inputs[1].op.name} is "
                             "stateful")
  assert _difference(a, b, strict=False) is None


def test_attributes_must_match_only_when_proving():
  a, b = _pair(lambda x, v, i: tf.reduce_sum(x, 0, keepdims=bool(i)))
  assert "attributes" in _difference(a, b, strict=True)
  assert _difference(a, b, strict=False) is None


def test_running_out_of_budget_is_a_difference_only_when_proving():

  def chain(x, v, i):
    y = tf.reduce_sum(x, 0)
    for _ in range(10):
      y = y * 1.5
    return y

  a, b = _pair(chain)
  assert _difference(a, b, strict=True, budget=3) == "too many ops to compare"
  assert _difference(a, b, strict=False, budget=3) is None
  assert _difference(a, b, strict=True, budget=64) is None


def test_look_through_stops_at_the_first_op_not_named():
  graph = tf.Graph()
  with graph.as_default():
    x = tf.constant(1.0)
    y = tf.identity(tf.identity(tf.cast(tf.identity(x), tf.float64)))
    assert _graph.look_through(y).op.type == "Cast"
    assert _graph.look_through(y, frozenset(["Identity", "Cast"])) is x
    assert _graph.look_through(x) is x
