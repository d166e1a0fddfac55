"""Routes optimizer methods to meetings while towers are built.

An optimizer's `minimize` (v1) or `get_updates` / `minimize` (Keras) is
called once per step on one device, with the whole batch's loss. In towers
every tower makes the call; it is a meeting (`_meet.meetings`): tower 0, the
last to make it, makes the optimizer's own call once, with the whole
batch's loss (its own: see `_meet.optimizer_calls`), in its own scopes, and
every tower gets that update. `compute_gradients` / `get_gradients` give every
tower one device's gradients and `apply_gradients` applies tower 0's once (see
`_meet.optimizer_calls`).

While towers are built (`routed`), the base classes' methods
(`tf.compat.v1.train.Optimizer`, `tf.keras.optimizers.legacy.Optimizer`) and
the overrides of their subclasses that exist then are routed this way when
called in a tower of several, so an optimizer needs no
wrapper. Calls made inside the once-call, by a TowerOptimizer, or anywhere
else pass straight through. Gradients computed inside the once-call are
colocated with their forward ops, so each tower's backward pass runs on
its device.
"""

import collections
import contextlib
import functools
import inspect
import threading
from typing import (
    Any,
    Callable,
    ContextManager,
    Counter,
    Dict,
    Iterable,
    Iterator,
    List,
    Literal,
    Optional,
    Sequence,
    Tuple,
)

import tensorflow as tf

from replicate import _context
from replicate import _graph
from replicate import _tf
from replicate._meet import meetings
from replicate._meet import optimizer_calls
from replicate._meet import transforms

_V1 = tf.compat.v1.train.Optimizer
_KERAS = tf.keras.optimizers.legacy.Optimizer
# A class attribute of replicate's own optimizer wrappers, which route their
# calls themselves (TowerOptimizer, KerasTowerOptimizer).
ROUTES_ITSELF = "_replicate_routes_itself"
_NO_TRANSFORMS = transforms.Pipeline(None)


class _Flags(threading.local):
  """How deep this thread is inside `direct()` and `colocating()`."""

  def __init__(self) -> None:
    super().__init__()
    self.depth: Counter[str] = collections.Counter()


_local = _Flags()


@contextlib.contextmanager
def _raised(flag: str) -> Iterator[None]:
  _local.depth[flag] += 1
  try:
    yield
  finally:
    _local.depth[flag] -= 1


def direct() -> ContextManager[None]:
  """Optimizer calls inside pass straight through (no meeting)."""
  return _raised("direct")


def colocating() -> ContextManager[None]:
  """Gradients computed inside are colocated with their forward ops."""
  return _raised("colocate")


def _colocates() -> bool:
  return bool(_local.depth["colocate"])


def routes() -> Optional[_context.Replication]:
  """The replication whose towers this optimizer call meets, or None."""
  if _local.depth["direct"]:
    return None
  return optimizer_calls.replicated()


@contextlib.contextmanager
def meeting_scope(replication: _context.Replication) -> Iterator[None]:
  """Where tower 0 makes a meeting's optimizer call.

  Its variables (slots) belong to no tower; its ops that follow no
  variable sit on the consolidation device, as the variables' updates run
  where the variables are.
  """
  with optimizer_calls.meeting_scope(replication), direct(), colocating():
    yield


def once(
    kind: str,
    loss: Any,
    variables: Any,
    call: Callable[[Any], Any],
    spec: meetings.Spec = meetings.OP,
    split: Optional[Tuple[Callable[[Any], Any], Callable[[Any], Any]]] = None
) -> Any:
  """`call(whole_batch_loss)` once, by tower 0; every tower gets its result.

  Args:
    kind: the call, for errors (e.g. "Adagrad.get_updates").
    loss: this tower's loss.
    variables: the variables the call names (None: unnamed); every tower
      must name the same.
    call: makes the optimizer's own call with the whole batch's loss.
    spec: the structure of the call's result (`_meet.meetings`).
    split: (compute, apply): the call as its two steps, `apply(compute(
      whole_batch_loss))`, for a call inside a tf.cond or tf.while_loop
      body: the gradients are taken outside it, where the other towers'
      rows are, and applied inside.
  """
  replication = optimizer_calls.replicated()
  assert replication is not None  # its callers route only in a tower
  names = None if variables is None else [
      v.op.name for v in tf.nest.flatten(variables)
  ]

  def build(values: List[Any]) -> List[Any]:
    whole = optimizer_calls.whole_batch_loss(replication, values, kind)
    if split is not None and optimizer_calls.in_control_flow(replication):
      compute, apply = split
      with optimizer_calls.meeting_scope(replication, pure=True), direct(), \
          colocating():
        grads = compute(whole)
      with meeting_scope(replication):
        result = apply(grads)
    else:
      with meeting_scope(replication):
        result = call(whole)
    replication.apply_calls += 1
    return [result] * len(values)

  return replication.meetings.meet(
      kind, loss, build, lambda value: spec, signature=names)


class GraphTape:
  """A stand-in for Keras' `tape` in graph mode: colocated tf.gradients.

  Keras' `minimize` of a tensor loss needs a tape that recorded the loss;
  the whole batch's loss is built after the towers' forward passes, so its
  gradients come from the graph instead, stopping at what the towers' own
  tapes (or `loss_fn` calls) did not record (`recorded`: graph positions).
  """

  def __init__(self, recorded: Sequence[Tuple[int, int]] = ()) -> None:
    self._recorded = list(recorded)

  def __enter__(self) -> "GraphTape":
    return self

  def __exit__(self, *unused: Any) -> Literal[False]:
    return False

  def watch(self, unused_tensor: Any) -> None:
    pass

  def gradient(self,
               target: Any,
               sources: Any,
               output_gradients: Any = None,
               **unused: Any) -> List[Any]:
    sources = tf.nest.flatten(sources)
    replication = _context.replication_on_thread()
    stops = [] if replication is None else optimizer_calls.unrecorded(
        replication, self._recorded, tf.nest.flatten(target), sources)

    def compute() -> List[Any]:
      grads = tf.compat.v1.gradients(
          target,
          sources,
          grad_ys=output_gradients,
          colocate_gradients_with_ops=True,
          stop_gradients=stops or None)
      return _one_device_grads(grads, sources)

    return optimizer_calls.among_trainers(compute, False)


def recorded_loss(loss: Any, tape: Any) -> Any:
  """Keras' `loss` called (a callable), noting in the replication what it
  recorded (or what the given `tape` did) for `GraphTape`."""
  replication = optimizer_calls.replicated()
  graph = tf.compat.v1.get_default_graph()
  if callable(loss):
    start = graph.version
    loss = loss()
    if replication is not None:
      replication.recorded.append((start, graph.version))
  elif tape is not None and replication is not None:
    replication.recorded.extend(optimizer_calls.tape_windows(tape, graph))
  return loss


def _one_device_grads(grads: Iterable[Any],
                      variables: Iterable[Any]) -> List[Any]:
  """`grads`, sparse rows as one device's (see
  `optimizer_calls.one_device_slices`)."""
  return [
      g for g, _ in optimizer_calls.one_device_slices(zip(grads, variables))
  ]


def call_with_loss(method: Callable[..., Any], args: Sequence[Any],
                   kwargs: Dict[str, Any], loss: Any, **replace: Any) -> Any:
  """`method(*args, **kwargs)` with its first argument `loss` and `replace`d
  arguments it names (e.g. colocate_gradients_with_ops=True)."""
  named = (inspect.Parameter.POSITIONAL_OR_KEYWORD,
           inspect.Parameter.KEYWORD_ONLY)
  try:
    signature = inspect.signature(method)
    parameters = list(signature.parameters.values())
    bound = signature.bind(*args, **kwargs)
  except (TypeError, ValueError):
    parameters = []
  if not parameters or parameters[0].kind not in (
      inspect.Parameter.POSITIONAL_ONLY,
      inspect.Parameter.POSITIONAL_OR_KEYWORD):
    # A mock or a function of *args: replace the loss only.
    if args:
      return method(loss, *args[1:], **kwargs)
    return method(**dict(kwargs, loss=loss))
  bound.arguments[parameters[0].name] = loss
  for name, value in replace.items():
    if name in signature.parameters and (signature.parameters[name].kind
                                         in named):
      bound.arguments[name] = value
  return method(*bound.args, **bound.kwargs)


def argument(args: Sequence[Any], kwargs: Dict[str, Any], name: str,
             position: int) -> Any:
  """A call's argument `name`, by keyword or at `args[position]`, or None."""
  if name in kwargs:
    return kwargs[name]
  return args[position] if len(args) > position else None


def _kind(optimizer: Any, method: str) -> str:
  return f"{type(optimizer).__name__}.{method}"


# Routes: (original method, optimizer, args after self, kwargs) -> result.
_Route = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]],
                  Any]


def v1_minimize_steps(
    optimizer: Any, args: Sequence[Any],
    kwargs: Dict[str,
                 Any]) -> Tuple[Callable[[Any], Any], Callable[[Any], Any]]:
  """(compute, apply): what v1 Optimizer.minimize(*args, **kwargs) does."""
  bound = inspect.signature(_V1.minimize).bind(optimizer, *args, **kwargs)
  bound.apply_defaults()
  call = bound.arguments

  def compute(whole: tf.Tensor) -> Any:
    return optimizer.compute_gradients(
        whole,
        var_list=call["var_list"],
        gate_gradients=call["gate_gradients"],
        aggregation_method=call["aggregation_method"],
        colocate_gradients_with_ops=True,
        grad_loss=call["grad_loss"])

  def apply(grads_and_vars: Any) -> Any:
    return optimizer.apply_gradients(
        grads_and_vars, global_step=call["global_step"], name=call["name"])

  return compute, apply


def _v1_minimize(original: Callable[..., Any], optimizer: Any,
                 args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
  bound = functools.partial(original, optimizer)
  loss = args[0] if args else kwargs.get("loss")
  var_list = argument(args, kwargs, "var_list", 2)
  return once(
      _kind(optimizer, "minimize"),
      loss,
      var_list,
      lambda whole: call_with_loss(
          bound, args, kwargs, whole, colocate_gradients_with_ops=True),
      split=v1_minimize_steps(optimizer, args, kwargs))


def _v1_compute_gradients(original: Callable[..., Any], optimizer: Any,
                          args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
  bound = functools.partial(original, optimizer)
  loss = args[0] if args else kwargs.get("loss")
  var_list = argument(args, kwargs, "var_list", 1)

  replication = optimizer_calls.replicated()
  assert replication is not None  # a route runs only in a tower

  def compute(whole: Any, unused_replicated: bool) -> Any:
    with meeting_scope(replication):
      return optimizer_calls.one_device_slices(
          call_with_loss(
              bound, args, kwargs, whole, colocate_gradients_with_ops=True))

  return optimizer_calls.whole_batch_gradients(
      loss, compute, var_list, call=_kind(optimizer, "compute_gradients"))


def _v1_compute_pass(original: Callable[..., Any], optimizer: Any,
                     args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
  if not _colocates():
    return original(optimizer, *args, **kwargs)
  # Inside a meeting (a routed minimize): the gradients it applies.
  return optimizer_calls.among_trainers(
      lambda: optimizer_calls.one_device_slices(
          call_with_loss(
              functools.partial(original, optimizer),
              args,
              kwargs,
              args[0] if args else kwargs.get("loss"),
              colocate_gradients_with_ops=True)), True)


def _apply_gradients(original: Callable[..., Any], optimizer: Any,
                     args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
  pairs = list(args[0] if args else kwargs.pop("grads_and_vars"))
  rest = args[1:]

  def apply(whole_pairs: Any) -> Any:
    with direct():
      return original(optimizer, whole_pairs, *rest, **kwargs)

  return optimizer_calls.transform_and_apply(
      pairs, _NO_TRANSFORMS, apply, call=_kind(optimizer, "apply_gradients"))


def _keras_get_updates(original: Callable[..., Any], optimizer: Any,
                       args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
  bound = functools.partial(original, optimizer)
  loss = args[0] if args else kwargs.get("loss")
  params = argument(args, kwargs, "params", 1)
  return once(
      _kind(optimizer, "get_updates"),
      loss,
      params,
      lambda whole: call_with_loss(bound, args, kwargs, whole),
      spec=[meetings.OP])


def _keras_get_gradients(original: Callable[..., Any], optimizer: Any,
                         args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
  bound = functools.partial(original, optimizer)
  loss = args[0] if args else kwargs.get("loss")
  params = tf.nest.flatten(argument(args, kwargs, "params", 1))

  replication = optimizer_calls.replicated()
  assert replication is not None  # a route runs only in a tower

  def compute(whole: Any, unused_replicated: bool) -> Any:
    with meeting_scope(replication):
      return call_with_loss(bound, args, kwargs, whole)

  return optimizer_calls.whole_batch_gradients(
      loss,
      compute,
      params,
      pairs=False,
      call=_kind(optimizer, "get_gradients"))


def _keras_get_gradients_pass(original: Callable[..., Any], optimizer: Any,
                              args: Tuple[Any, ...], kwargs: Dict[str,
                                                                  Any]) -> Any:
  if not _colocates():
    return original(optimizer, *args, **kwargs)
  # Inside a meeting (a routed get_updates): the gradients it applies.
  if original is not _BASE_GET_GRADIENTS:
    return optimizer_calls.among_trainers(
        lambda: original(optimizer, *args, **kwargs), False)
  loss = args[0] if args else kwargs["loss"]
  params = tf.nest.flatten(args[1] if len(args) > 1 else kwargs["params"])
  return optimizer_calls.among_trainers(
      lambda: _colocated_keras_gradients(optimizer, loss, params), False)


def _colocated_keras_gradients(optimizer: Any, loss: tf.Tensor,
                               params: List[Any]) -> List[Any]:
  """What Keras' OptimizerV2.get_gradients computes, colocated."""
  # `_name` is Keras' private optimizer name; its get_gradients uses it too.
  with tf.name_scope(_tf.optimizer_name(optimizer) + "/gradients"):
    grads = tf.compat.v1.gradients(
        loss, params, colocate_gradients_with_ops=True)
  optimizer_calls.require_gradients(grads, params)
  return _one_device_grads(grads, params)


def _keras_minimize(original: Callable[..., Any], optimizer: Any,
                    args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
  loss = args[0] if args else kwargs.get("loss")
  var_list = argument(args, kwargs, "var_list", 1)
  loss = recorded_loss(loss, argument(args, kwargs, "tape", 4))
  if callable(var_list):
    var_list = var_list()
  var_list = tf.nest.flatten(var_list)
  rest = dict(kwargs)
  rest.pop("loss", None)
  rest.pop("var_list", None)
  rest.pop("tape", None)
  positional = list(args[2:])
  if len(positional) >= 3:  # grad_loss, name, tape
    positional = positional[:2]
  replication = optimizer_calls.replicated()
  assert replication is not None  # routed in towers only
  return once(
      _kind(optimizer, "minimize"), loss, var_list, lambda whole: original(
          optimizer,
          whole,
          var_list,
          *positional,
          tape=GraphTape(replication.recorded),
          **rest))


_BASE_GET_GRADIENTS = _KERAS.__dict__["get_gradients"]

# method name -> (route in towers, call elsewhere or None for the original)
_ROUTES: Dict[Any, Dict[str, Tuple[_Route, Optional[_Route]]]] = {
    _V1: {
        "minimize": (_v1_minimize, None),
        "compute_gradients": (_v1_compute_gradients, _v1_compute_pass),
        "apply_gradients": (_apply_gradients, None)
    },
    _KERAS: {
        "get_updates": (_keras_get_updates, None),
        "get_gradients": (_keras_get_gradients, _keras_get_gradients_pass),
        "minimize": (_keras_minimize, None),
        "apply_gradients": (_apply_gradients, None)
    },
}


def _routed_method(original: Callable[..., Any], route: _Route,
                   elsewhere: Optional[_Route]) -> Callable[..., Any]:

  @functools.wraps(original)
  def method(self: Any, *args: Any, **kwargs: Any) -> Any:
    if not getattr(self, ROUTES_ITSELF, False) and routes() is not None:
      return route(original, self, args, kwargs)
    if elsewhere is not None:
      return elsewhere(original, self, args, kwargs)
    return original(self, *args, **kwargs)

  return method


def _iterations_property(original: property) -> property:
  """Keras' `iterations`, where setting the variable it has is a no-op.

  The v2 canned heads set `iterations` to the global step in every tower;
  an optimizer instance shared by the towers has it after tower 0's.
  `_iterations` is Keras' private attribute behind the property.
  """

  def setter(self: Any, variable: Any) -> None:
    if _tf.keras_iterations(self) is variable:
      return
    # Keras' `iterations` has a setter (an fset of None fails here as before).
    original.fset(self, variable)  # type: ignore[misc]

  return property(original.fget, setter, original.fdel, original.__doc__)


def _subclasses(base: type) -> List[type]:
  seen = _graph.walk([base], lambda cls: cls.__subclasses__())
  return [
      c for c in seen if not c.__dict__.get(ROUTES_ITSELF, False) and not any(
          b.__dict__.get(ROUTES_ITSELF, False) for b in c.__mro__)
  ]


def _install() -> _tf.Patched:
  originals = []
  for base, methods in _ROUTES.items():
    for cls in _subclasses(base):
      for name, (route, elsewhere) in methods.items():
        original = cls.__dict__.get(name)
        if inspect.isfunction(original):
          originals.append(
              _tf.patch(cls, name, _routed_method(original, route, elsewhere)))
  iterations = _KERAS.__dict__.get("iterations")
  if isinstance(iterations, property):
    originals.append(
        _tf.patch(_KERAS, "iterations", _iterations_property(iterations)))
  return originals


_PATCHES = _tf.Patches("optimizer calls in towers", _install)


def routed(replication: _context.Replication) -> ContextManager[None]:
  """Optimizer calls in the towers meet while inside (see above)."""
  return _PATCHES.applied(replication.num_towers > 1)
