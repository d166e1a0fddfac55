"""The package's layout: stages in order, TensorFlow internals in `_tf`.

Read from the code itself (its imports and attribute accesses), so that a
change that breaks the layout fails here rather than in a reader's head.
"""

import ast
import importlib.util
import pathlib
from typing import Dict, List, Set

import pytest

# The package the suite imports: the checkout's, or in CI the installed
# wheel's (the checkout copy there has no `replicate/`).
_PACKAGE = pathlib.Path(importlib.util.find_spec("replicate").origin).parent

# The order a step is built in; a module imports only its own stage's
# modules, earlier stages' and the shared ones.
_ORDER = [
    "_tf", "_graph", "_context", "_prepare", "_towers", "_batch", "_batch_norm",
    "_meet", "_merge", "_core", "testing", "__init__", "__main__",
    "pytest_plugin"
]
# Names of namedtuples' public API that start with an underscore.
_NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make"}
_PRIVATE_MODULES = ("tensorflow.python", "tensorflow.core", "keras.src",
                    "tensorflow_estimator.python", "tf_keras.src")


def _modules() -> Dict[str, ast.Module]:
  found = {}
  for path in sorted(_PACKAGE.rglob("*.py")):
    name = ".".join(path.relative_to(_PACKAGE.parent).with_suffix("").parts)
    found[name.removesuffix(".__init__")] = ast.parse(path.read_text())
  return found


def _stage(module: str) -> int:
  parts = module.split(".")
  return _ORDER.index(parts[1] if len(parts) > 1 else "__init__")


def _imports(tree: ast.Module, modules: Set[str]) -> Set[str]:
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module.startswith("replicate")):
      for alias in node.names:
        candidate = f"{node.module}.{alias.name}"
        found.add(candidate if candidate in modules else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("replicate"))
  return found


def test_every_module_is_placed_in_a_stage():
  for module in _modules():
    _stage(module)  # raises ValueError for a module outside the order


def test_imports_point_to_earlier_stages_only():
  modules = _modules()
  backwards = []
  for module, tree in modules.items():
    for imported in _imports(tree, set(modules)):
      if imported in ("replicate", module) or imported.startswith(
          "replicate.testing") and module.startswith("replicate.testing"):
        continue
      if _stage(imported) > _stage(module):
        backwards.append(f"{module} imports {imported}")
  assert not backwards


def test_no_import_cycles():
  modules = _modules()
  graph = {
      m: _imports(t, set(modules)) - {"replicate", m}
      for m, t in modules.items()
      if m != "replicate"
  }
  state: Dict[str, int] = {}

  def visit(module: str, path: List[str]):
    state[module] = 1
    for imported in graph.get(module, ()):
      if state.get(imported) == 1:
        pytest.fail("import cycle: " + " -> ".join(path + [imported]))
      if imported not in state:
        visit(imported, path + [imported])
    state[module] = 2

  for module in graph:
    if module not in state:
      visit(module, [module])


# Documented attributes of namedtuples, whose names start with "_".
_NAMEDTUPLE_API = ("_fields", "_asdict", "_replace", "_make")


def _private_accesses(tree: ast.Module) -> List[str]:
  found = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [node.module or ""] if isinstance(
          node, ast.ImportFrom) else [a.name for a in node.names]
      found += [
          f"line {node.lineno}: import {n}" for n in names
          if n.startswith(_PRIVATE_MODULES)
      ]
    elif isinstance(node, ast.Attribute):
      attr = node.attr
      if (attr.startswith("_") and not attr.endswith("__") and
          attr not in _NAMEDTUPLE_API and
          not (isinstance(node.value, ast.Name) and
               node.value.id in ("self", "cls"))):
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
    elif isinstance(node, ast.Call) and isinstance(
        node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
      found.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id in ("getattr", "hasattr") and len(node.args) > 1 and
          isinstance(node.args[1], ast.Constant) and
          isinstance(node.args[1].value, str) and
          node.args[1].value.startswith("_") and
          not node.args[1].value.endswith("__") and
          node.args[1].value not in _NAMEDTUPLE_API):
      # A private attribute read by name is a private access too.
      found.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    elif isinstance(node, ast.Assign):
      for target in node.targets:
        root = target
        while isinstance(root, ast.Attribute):
          root = root.value
        if (isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and
            (root.id in ("tf", "keras") or root.id.lstrip("_")[:1].isupper())):
          found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
  return found


def test_tensorflow_internals_only_in_tf_module():
  offending = {
      module: found
      for module, tree in _modules().items()
      if module != "replicate._tf" and not module.startswith("replicate._tf.")
      and (found := _private_accesses(tree))
  }
  assert not offending


def test_the_fence_sees_what_it_fences():
  tree = ast.parse("from tensorflow.python.ops import array_ops\n"
                   "op._update_input(0, x)\n"
                   "setattr(tf.nn, 'relu', f)\n"
                   "tf.GradientTape.gradient = g\n"
                   "spec._replace(loss=1)\n"
                   "self._own = 1\n"
                   "getattr(estimator, '_warm_start_settings', None)\n"
                   "hasattr(leaf, '_fields')\n")
  found = _private_accesses(tree)
  assert sorted(f.split(":")[0] for f in found) == [
      "line 1", "line 2", "line 3", "line 4", "line 7"
  ]


def test_the_layout_sees_the_package():
  # The package is found where it is imported from (in CI, the wheel's).
  modules = _modules()
  assert len(modules) > 50 and "replicate._core" in modules, sorted(modules)


def test_every_module_says_what_it_holds():
  missing = [m for m, tree in _modules().items() if not ast.get_docstring(tree)]
  assert not missing
