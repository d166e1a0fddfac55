"""Device discovery, validation and placement for towers.

Which devices to use, where inputs are split and results merged (the
consolidation device), and the device function each tower builds under.
Other modules place ops on the devices chosen here: `_meet.all_reduce`
(the ring between tower devices), `_merge.mirrored` (a variable's copy on
every tower device) and `_batch_norm.whole_batch` (the whole batch's
kernel or moments where the towers meet).
"""

import enum
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

from absl import logging
import tensorflow as tf

_HOST_CPU = "/device:CPU:0"

# Ops that hold state and so must live where the variable lives.
_STATEFUL_VARIABLE_OPS = frozenset([
    "Variable",
    "VariableV2",
    "AutoReloadVariable",
    "VarHandleOp",
    "MutableHashTable",
    "MutableHashTableV2",
    "MutableHashTableOfTensors",
    "MutableHashTableOfTensorsV2",
    "MutableDenseHashTable",
    "MutableDenseHashTableV2",
])

# Gathers whose gradient TensorFlow colocates with the gathered tensor.
_GATHER_OPS = frozenset(["Gather", "GatherV2"])
# Ops through which a tensor is still a variable's handle, reference or value.
_VALUE_FORWARDING_OPS = frozenset(["Identity", "ReadVariableOp"])
# Conds, whose lowering colocates a Switch with each input (after the
# predicate or branch index).
_COND_OPS = frozenset(["If", "StatelessIf", "Case", "StatelessCase"])
# Function calls pass variable handles on to a body placed on its own.
_FUNCTION_CALL_OPS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])


class VariablePlacement(str, enum.Enum):
  """Where the model's variables live.

  SHARED puts every variable on the consolidation device (the single GPU,
  else the host CPU). ROUND_ROBIN spreads them over the tower devices, each
  new variable to the device holding the fewest bytes of variables so far.
  MIRRORED keeps a copy of each trained variable (and of its optimizer
  slots) on every tower device: the gradients are summed between the
  devices by a ring all-reduce and every device applies the same update to
  its copy; checkpoints hold one copy. It is the default for GPU towers.
  """
  SHARED = "shared"
  ROUND_ROBIN = "round_robin"
  MIRRORED = "mirrored"


def as_variable_placement(
    value: Union[VariablePlacement, str, None]) -> Optional[VariablePlacement]:
  """Accepts a VariablePlacement or its string value (None: the default,
  decided by `default_placement` once the devices are known).

  Raises:
    TypeError: `value` is neither.
    ValueError: a string that names no placement.
  """
  if value is None:
    return None
  if not isinstance(value, (VariablePlacement, str)):
    raise TypeError(
        f"variable_placement={value!r} is of type {type(value).__name__}; "
        "pass a replicate.VariablePlacement or its string value, e.g. "
        "'shared', or None for the default.")
  try:
    return VariablePlacement(value)
  except ValueError:
    choices = ", ".join(repr(p.value) for p in VariablePlacement)
    raise ValueError(
        f"variable_placement {value!r} is not supported; pass one of "
        f"replicate.VariablePlacement or the strings {choices}.") from None


def local_devices() -> List[str]:
  """Every local GPU, or the host CPU when there is none."""
  gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
  devices = [canonical_device(d) for d in gpus] or [_HOST_CPU]
  logging.info("replicate: no devices given, using local devices %s", devices)
  return devices


def canonical_device(device: str) -> str:
  """Returns `device` in TensorFlow's full form, e.g. '/device:GPU:1'."""
  if not isinstance(device, str):
    raise TypeError(
        f"Device {device!r} is of type {type(device).__name__}, not a device "
        "name; pass strings such as '/device:GPU:0' or '/cpu:1'.")
  if not device.strip():
    raise ValueError(
        f"Device {device!r} is empty; pass names such as '/device:GPU:0' or "
        "'/cpu:1'.")
  try:
    spec = tf.DeviceSpec.from_string(device.strip())
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"Device {device!r} is not a valid device name ({e}); pass strings "
        "such as '/device:GPU:0' or '/cpu:1'.") from None
  if spec.device_type is None or spec.device_index is None:
    raise ValueError(
        f"Device {device!r} does not name one device: it needs a type and an "
        "index, e.g. '/device:GPU:0'.")
  return spec.to_string()


def resolve_devices(devices: Optional[Sequence[str]]) -> List[str]:
  """Validates and canonicalises `devices`; None means every local GPU."""
  if devices is None:
    return local_devices()
  if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
    raise TypeError(
        f"devices={devices!r} is of type {type(devices).__name__}; pass a "
        "list of device names, e.g. ['/device:GPU:0', '/device:GPU:1'], or "
        "None for every local GPU.")
  devices = list(devices)
  if not devices:
    raise ValueError(
        "devices=[] names no device; pass at least one device name, or None "
        "for every local GPU.")
  resolved = []
  for device in devices:
    canonical = canonical_device(device)
    if canonical in resolved:
      raise ValueError(
          f"Device {device!r} is listed twice in devices={devices!r} (as "
          f"{canonical!r}); list each device once.")
    resolved.append(canonical)
  return resolved


def _local_device_counts(
    config: Optional[tf.estimator.RunConfig]) -> Dict[str, int]:
  """Device type -> how many devices of that type this process has.

  The logical devices, and for CPU at least as many as the session config
  of `config` (the Estimator's RunConfig) asks for with `device_count`, the
  way graph-mode sessions get virtual CPU devices.
  """
  counts: Dict[str, int] = {}
  for device in tf.config.list_logical_devices():
    spec = tf.DeviceSpec.from_string(device.name)
    counts[spec.device_type] = max(
        counts.get(spec.device_type, 0), spec.device_index + 1)
  session_config = getattr(config, "session_config", None)
  if session_config is not None:
    cpus = session_config.device_count.get("CPU", 0)
    counts["CPU"] = max(counts.get("CPU", 0), cpus)
  return counts


def _device_names(counts: Dict[str, int]) -> str:
  return ", ".join(f"'/device:{kind}:{index}'" for kind in sorted(counts)
                   for index in range(counts[kind]))


def _missing_device_message(device: str, kind: str, counts: Dict[str,
                                                                 int]) -> str:
  """Why `device` is refused, what exists and how to get more devices."""
  if kind not in counts:
    what = f"this machine has no {kind} device"
  else:
    what = f"this machine has {counts[kind]} {kind} device(s)"
  message = (f"Device {device!r} does not exist: {what}; the local devices "
             f"are {_device_names(counts)}. Pass devices from that list")
  if kind == "CPU":
    message += (", or make more CPU devices: split the CPU with "
                "tf.config.set_logical_device_configuration before TensorFlow "
                "initialises, or give the Estimator a session with as many, "
                "RunConfig(session_config=tf.compat.v1.ConfigProto("
                "device_count={'CPU': N}))")
  return message + "."


def check_local_devices(
    devices: Sequence[str],
    config: Optional[tf.estimator.RunConfig] = None) -> None:
  """Refuses device names that provably no local device answers to.

  Only devices of this process are checked: a name with a job, replica or
  task is left to TensorFlow's runtime. GPU names on a machine without any
  GPU are accepted with a warning: soft placement runs them on the CPU,
  which is how multi-GPU code is tested without GPUs. A CPU index beyond
  the local CPUs is refused only where the session's CPUs are known (an
  explicit logical split, or `config`, whose session makes as many as its
  `device_count` asks); without `config` the caller makes its own session,
  e.g. `Session(config=ConfigProto(device_count={'CPU': 4}))` as tf.contrib's
  tests did, so such names are accepted with a warning. CPUs of a logical
  split that the Estimator's session will not make (see `_check_session_cpus`)
  are named in a warning, or refused without soft placement.

  Args:
    devices: canonical device names, as `resolve_devices` returns them.
    config: the `tf.estimator.RunConfig` the model_fn was given, or None.

  Raises:
    ValueError: a device's type or index provably does not exist locally,
      or the session will not have it and does not allow soft placement.
  """
  counts = _local_device_counts(config)
  without_gpu, unknown_cpus, local_cpus = [], [], []
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    if any(part is not None for part in (spec.job, spec.replica, spec.task)):
      continue
    if spec.device_type == "GPU" and "GPU" not in counts:
      without_gpu.append(device)
    elif spec.device_index < counts.get(spec.device_type, 0):
      if spec.device_type == "CPU":
        local_cpus.append(device)
    elif spec.device_type == "CPU" and _session_cpus_unknown(config, counts):
      unknown_cpus.append(device)
    else:
      raise ValueError(
          _missing_device_message(device, spec.device_type, counts))
  if without_gpu:
    logging.warning(
        "replicate: this machine has no GPU; devices %s run where soft "
        "placement puts them (allow_soft_placement=True), or fail without it",
        without_gpu)
  if unknown_cpus:
    logging.warning(
        "replicate: the model_fn got no config, so this process has %d CPU "
        "device(s) as far as is known; devices %s must be made by the session "
        "that runs the graph (ConfigProto(device_count={'CPU': N})), or it "
        "fails to place them", counts.get("CPU", 0), unknown_cpus)
  if config is not None:
    _check_session_cpus(local_cpus, getattr(config, "session_config", None))


# (devices, session CPUs) already warned about: the model_fn runs for every
# train, evaluate and predict call, the decision is the same each time.
_WARNED_SESSION_CPUS: Set[Tuple[Tuple[str, ...], int]] = set()


def _check_session_cpus(
    cpus: Sequence[str],
    session_config: Optional[tf.compat.v1.ConfigProto]) -> None:
  """Says so where towers name CPUs the Estimator's session will not have.

  A logical split of the CPU (`tf.config.set_logical_device_configuration`)
  makes CPUs for eager code and for sessions opened without a config, but
  the Estimator opens its sessions with `RunConfig.session_config` (its
  default when None), which has one CPU unless `device_count` asks for
  more. The model_fn gets a copy of the RunConfig, so it cannot give the
  session more CPUs: the towers on CPUs the session lacks would run on
  '/device:CPU:0', one after another (soft placement), or fail to place.

  Raises:
    ValueError: the session lacks some of `cpus` and does not allow soft
      placement (it would fail to place them).
  """
  have = 1 if session_config is None else max(
      1, session_config.device_count.get("CPU", 1))
  missing = [
      d for d in cpus if tf.DeviceSpec.from_string(d).device_index >= have
  ]
  if not missing:
    return
  need = 1 + max(tf.DeviceSpec.from_string(d).device_index for d in cpus)
  fix = (f"give the Estimator a session with {need} CPUs: tf.estimator."
         f"RunConfig(session_config=replicate.testing.session_config({need})"
         f") or tf.compat.v1.ConfigProto(device_count={{'CPU': {need}}})")
  if session_config is not None and not session_config.allow_soft_placement:
    raise ValueError(
        f"Devices {missing} are CPUs of this process's logical split that "
        f"the Estimator's session will not have: RunConfig.session_config "
        f"makes {have} CPU device(s) (device_count) and does not allow soft "
        f"placement, so the session cannot place them; {fix}.")
  key = (tuple(cpus), have)
  if key in _WARNED_SESSION_CPUS:
    return
  _WARNED_SESSION_CPUS.add(key)
  logging.warning(
      "replicate: devices %s are CPUs of this process's logical split that "
      "the Estimator's session will not have (RunConfig.session_config makes "
      "%d CPU device(s)): soft placement runs those towers on "
      "'/device:CPU:0', one after another; %s", missing, have, fix)


def _session_cpus_unknown(config: Optional[tf.estimator.RunConfig],
                          counts: Dict[str, int]) -> bool:
  """Whether the session that runs the graph may have more CPUs than known.

  With a RunConfig the Estimator's session has what its `device_count` asks
  (or one); an explicit logical split of the CPU (more than one logical CPU)
  is taken as the number meant. Otherwise the caller's own session decides.
  """
  return config is None and counts.get("CPU", 0) <= 1


def consolidation_device(devices: Sequence[str]) -> str:
  """Where inputs are split and results merged.

  The single GPU when all towers share it, otherwise the host CPU of the
  towers' machine (so that no GPU becomes the hub of every transfer).
  """
  if len(devices) == 1:
    return devices[0]
  host = tf.DeviceSpec.from_string(devices[0]).replace(
      device_type="CPU", device_index=0)
  return host.to_string()


def on_task_of(device: str, other: str) -> str:
  """`device` on `other`'s job and task where it names none itself."""
  spec = tf.DeviceSpec.from_string(device or "")
  place = tf.DeviceSpec.from_string(other or "")
  return tf.DeviceSpec(
      job=place.job, replica=place.replica,
      task=place.task).make_merged_spec(spec).to_string()


def default_placement(devices: Sequence[str]) -> VariablePlacement:
  """MIRRORED for several GPU towers, else SHARED."""
  gpus = all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in devices)
  return (VariablePlacement.MIRRORED
          if gpus and len(devices) > 1 else VariablePlacement.SHARED)


def variable_device_chooser(placement: VariablePlacement,
                            devices: Sequence[str],
                            mirrored: bool) -> Callable[[tf.Operation], str]:
  """Returns a function that picks the device of each new variable op.

  `mirrored`: whether MIRRORED copies the variables this time (on one
  machine): then every variable starts on tower 0's device, where the
  update is built and the other devices' copies are filled from;
  otherwise (a cluster) MIRRORED spreads them as ROUND_ROBIN does.
  """
  if placement is VariablePlacement.SHARED:
    device = consolidation_device(devices)
    return lambda op: device
  if mirrored:
    return lambda op: devices[0]
  return _LeastBytes(devices)


class _LeastBytes:
  """ROUND_ROBIN: each new variable op goes to the device holding the fewest
  bytes of variables so far (the first such in `devices` on a tie), so that
  devices hold about as many bytes, moving statistics and other non-trained
  variables counted, whatever order the model creates them in."""

  def __init__(self, devices: Sequence[str]) -> None:
    self._held = {device: 0 for device in devices}

  def __call__(self, op: tf.Operation) -> str:
    device = min(self._held, key=self._held.__getitem__)
    self._held[device] += _variable_bytes(op)
    logging.vlog(1, "replicate: variable %s on %s", op.name, device)
    return device


def _variable_bytes(op: tf.Operation) -> int:
  """The bytes a variable op holds, from its shape and dtype attributes (an
  unknown dimension counted as 1; 0 for ops without them, e.g. tables)."""
  try:
    shape = tf.TensorShape(op.get_attr("shape"))
    dtype = tf.as_dtype(op.get_attr("dtype"))
  except ValueError:
    return 0
  dims = [1 if d is None else d for d in shape.as_list()
         ] if shape.rank is not None else [1]
  size = 1
  for dim in dims:
    size *= dim
  return size * dtype.size


def tower_device_function(
    tower_device: str,
    choose_variable_device: Callable[[tf.Operation], str],
) -> Callable[[tf.Operation], str]:
  """Device function for one tower.

  Variable ops go where `choose_variable_device` says; an op that must run
  where a variable lives (see `_variable_device`) goes there; every other op
  to the tower's device. A device the user set on an op (with an inner
  `tf.device`) takes precedence field by field, as `tf.device` nests.
  """

  def device_function(op: tf.Operation) -> str:
    user_spec = tf.DeviceSpec.from_string(op.device or "")
    if op.type in _STATEFUL_VARIABLE_OPS:
      base = tf.DeviceSpec.from_string(choose_variable_device(op))
    else:
      device = _variable_device(op)
      base = tf.DeviceSpec.from_string(tower_device if device is
                                       None else device)
    return base.make_merged_spec(user_spec).to_string()

  return device_function


def _variable_device(op: tf.Operation) -> Optional[str]:
  """The device of the one variable `op` must run with ('' if it has
  none), or None where `op` takes no variable.

  TensorFlow's placer runs an op that takes a variable's handle or
  reference where the variable lives, whatever device the op asks for. The
  gradient of a gather colocates with the gathered variable
  (`array_grad._GatherV2Grad`), and a lowered cond colocates each Switch
  with its input. Ops colocated with such an op (its gradient, with
  `colocate_gradients_with_ops`; its Switches) take the device the op asked
  for, so asking for the tower's would make them conflict with the
  variable's, which only soft placement resolves. Function calls are left
  on the tower, as the placer leaves them: their bodies are placed op by op.
  """
  if op.type in _FUNCTION_CALL_OPS:
    return None
  # A reference's dtype differs from its base dtype (float32_ref, float32).
  tensors = [
      t for t in op.inputs
      if t.dtype == tf.resource or t.dtype != t.dtype.base_dtype
  ]
  if op.type in _GATHER_OPS and op.inputs:
    tensors.append(op.inputs[0])
  elif op.type in _COND_OPS:
    tensors.extend(op.inputs[1:])
  devices = set()
  for tensor in tensors:
    source = _variable_source(tensor)
    if source is not None:
      devices.add(source.device)
  # A variable placed nowhere (made before the towers, outside any device
  # scope) is placed where its readers are: they ask for no device either.
  return devices.pop() if len(devices) == 1 else None


def _variable_source(tensor: tf.Tensor) -> Optional[tf.Operation]:
  """The variable op whose handle, reference or value `tensor` is, or None.

  Inside a function body (a cond's branch, a loop's body) a captured
  variable is a placeholder; its source is the captured outer tensor's. A
  copy on another task (the towers' one read per step of a parameter
  server's variable, see `_towers.sharing.read_once_per_step`) is a value of its
  own, not the variable.
  """
  copies = []
  while True:
    op = tensor.op
    if op.type in _VALUE_FORWARDING_OPS and op.inputs:
      copies.append(op.device)
      tensor = op.inputs[0]
    elif op.type == "Placeholder" and _captured(tensor) is not None:
      tensor = _captured(tensor)
    elif op.type in _STATEFUL_VARIABLE_OPS:
      if any(other_task(device, op.device) for device in copies):
        return None
      return op
    else:
      return None


def _captured(tensor: tf.Tensor) -> Optional[tf.Tensor]:
  """The outer tensor a function body's placeholder captures, or None."""
  for external, internal in getattr(tensor.graph, "captures", ()):
    if internal is tensor:
      return external if isinstance(external, tf.Tensor) else None
  return None


def device_key(device: Optional[str]) -> Tuple[Any, ...]:
  """(job, replica, task, device type, index) of a device name, for
  comparing names written differently ('/gpu:1', '/device:GPU:1')."""
  spec = tf.DeviceSpec.from_string(device or "")
  return spec.job, spec.replica, spec.task, spec.device_type, spec.device_index


def _task(device: str) -> Tuple[Any, ...]:
  return device_key(device)[:3]


def other_task(device: str, other: str) -> bool:
  """Whether both devices name a job and their tasks differ."""
  return bool(_task(device)[0] and _task(other)[0]) and (_task(device)
                                                         != _task(other))


def cache_device(graph: tf.Graph, op_names: Iterable[str],
                 consolidation_device: str) -> Optional[str]:
  """Where a parameter-server variable's one read per step is, or None.

  The consolidation device as the outer device functions placed it (the
  ops in `op_names` were built under `tf.device(consolidation_device)`,
  e.g. Estimator's `replica_device_setter` adds '/job:worker/task:0').
  None where the towers' devices name no job: one machine without a
  cluster, where variables are on the towers' own machine and nothing is
  cached.
  """
  consolidation_spec = tf.DeviceSpec.from_string(consolidation_device)
  for name in sorted(op_names):
    device = graph.get_operation_by_name(name).device
    spec = tf.DeviceSpec.from_string(device or "")
    if (spec.device_type,
        spec.device_index) == (consolidation_spec.device_type,
                               consolidation_spec.device_index):
      return device if spec.job else None
  return None
