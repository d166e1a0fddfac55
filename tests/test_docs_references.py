"""Docstrings, comments and docs name modules and attributes that exist.

The code and the docs name the package's private modules relative to the
package (`_batch.row_kinds`, `_meet.rewiring.Rewiring.advance`, `_tf`) or
in full (`replicate._tf`, `replicate.testing.assert_replicates`). When a
module is split, folded or renamed, such names go stale silently; this
test resolves every one of them.

Scanned: every docstring (module, class, function) and comment of
replicate/**/*.py, where a name may stand with or without backticks; and
README.md, BUILD.md, docs/*.md and benchmarks/README.md, where names in
backticks and in fenced code blocks count. CHANGELOG.md and
benchmarks/history.md are records and keep the names of their day.

A name counts as a reference into the package when it starts with
`replicate.`, or with one of the package's own `_` modules or
subpackages followed by a dot; file paths (`replicate/_tf.py`) are not
names. A name under a module the package used to have (`_sharing.x`,
before the stage subpackages) is stale, unless the file imports something
under that name. Only importing: nothing builds a graph.
"""

import ast
import importlib
import importlib.util
import inspect
import io
import pathlib
import re
import sys
import tokenize
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

_ROOT = pathlib.Path(__file__).resolve().parent.parent
# The package the suite imports: the checkout's, or in CI the installed
# wheel's (the checkout copy there has no `replicate/`).
_PACKAGE = pathlib.Path(importlib.util.find_spec("replicate").origin).parent
_DOCS = ["README.md", "BUILD.md", "docs/*.md", "benchmarks/README.md"]

# Top-level modules the package had before its stage subpackages; nothing
# may be named under them any more.
_FORMER = ("_aggregate", "_cluster", "_collectives", "_devices", "_gather",
           "_hooks", "_host_relu", "_inputs", "_keras_optimizer", "_lockstep",
           "_lookups", "_loss", "_meetings", "_nn_batch_norm", "_optimizer",
           "_own_gradients", "_patches", "_routing", "_rows", "_scalars",
           "_sharing", "_source", "_split", "_state", "_step_ops", "_summaries",
           "_tpu", "_tracking", "_transform", "_variance", "_whole")


def _own_modules() -> List[str]:
  """The package's `_` modules and subpackages: `_batch`, `_tf`, ..."""
  names = []
  for path in _PACKAGE.iterdir():
    name = path.stem if path.suffix == ".py" else path.name
    if (name.startswith("_") and not name.startswith("__") and
        (path.suffix == ".py" or (path / "__init__.py").exists())):
      names.append(name)
  return sorted(names)


_NAME = r"[A-Za-z_]\w*"


def _pattern(firsts: List[str]) -> "re.Pattern[str]":
  alternatives = "|".join(sorted(map(re.escape, firsts), key=len, reverse=True))
  # Not inside a longer name, attribute chain or path; at least one dot.
  return re.compile(rf"(?<![\w./\\-])((?:{alternatives})(?:\.{_NAME})+)"
                    rf"(?![\w/\\-])")


def references(text: str, firsts: List[str]) -> List[str]:
  """Dotted names in `text` starting with one of `firsts`, paths left out."""
  found = []
  for match in _pattern(firsts).finditer(text):
    name = match.group(1)
    if name.endswith(".py"):
      continue
    found.append(name)
  return found


def _import_aliases(tree: ast.Module, module: str) -> Dict[str, str]:
  """Names a module binds to modules or objects of the package."""
  aliases = {}
  package = module.rsplit(".", 1)[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("replicate.") and alias.asname:
          aliases[alias.asname] = alias.name
    elif isinstance(node, ast.ImportFrom):
      source = node.module or ""
      if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([source] if source else []))
      if source == "replicate" or source.startswith("replicate."):
        for alias in node.names:
          aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
  return aliases


def _declared(cls: type, name: str) -> bool:
  """Whether a class declares `name` without a class attribute: a field
  (annotated, as dataclasses' with factories) or `self.name = ...`."""
  for klass in inspect.getmro(cls):
    if name in getattr(klass, "__annotations__", {}):
      return True
  try:
    source = inspect.getsource(cls)
  except (OSError, TypeError):
    return False
  assignment = rf"\bself\.{re.escape(name)}\s*(:[^=]*)?="
  return re.search(assignment, source) is not None


def resolve(dotted: str) -> Optional[str]:
  """None if `dotted` (full or relative to `replicate`) names a module or
  attribute of the package, else what is missing.

  A submodule of `replicate` imported only to look is removed again:
  importing it sets it on the package, whose namespace is tested as it is
  (`tests/test_public_api.py`).
  """
  loaded = set(sys.modules)
  try:
    return _resolve(dotted)
  finally:
    for name in set(sys.modules) - loaded:
      parent, _, child = name.rpartition(".")
      if parent == "replicate":
        del sys.modules[name]
        vars(sys.modules[parent]).pop(child, None)


def _resolve(dotted: str) -> Optional[str]:
  parts = dotted.split(".")
  if parts[0] != "replicate":
    parts = ["replicate"] + parts
  obj = importlib.import_module("replicate")
  path = "replicate"
  for part in parts[1:]:
    path = f"{path}.{part}"
    if inspect.ismodule(obj):
      try:
        obj = importlib.import_module(path)
        continue
      except ModuleNotFoundError as error:
        if error.name != path:
          raise
    try:
      obj = getattr(obj, part)
      continue
    except AttributeError:
      pass
    if inspect.isclass(obj) and _declared(obj, part):
      return None
    return f"no {path}"
  return None


def _python_texts(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
  """(line, text) of each docstring and comment of a Python file."""
  source = path.read_text()
  tree = ast.parse(source)
  for node in ast.walk(tree):
    if isinstance(
        node,
        (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if (body and isinstance(body[0], ast.Expr) and
          isinstance(body[0].value, ast.Constant) and
          isinstance(body[0].value.value, str)):
        yield body[0].lineno, body[0].value.value
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT:
      yield token.start[0], token.string


def _markdown_texts(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
  """(line, text) of each code span and fenced code block of a Markdown
  file."""
  lines = path.read_text().split("\n")
  prose: List[Tuple[int, str]] = []
  fenced = False
  for number, line in enumerate(lines, 1):
    if line.lstrip().startswith("```"):
      fenced = not fenced
    elif fenced:
      yield number, line
    else:
      prose.append((number, line))
  # Code spans may wrap; find them in the prose joined, then map back.
  text = "\n".join(line for _, line in prose)
  starts = []
  offset = 0
  for _, line in prose:
    starts.append(offset)
    offset += len(line) + 1
  for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
    index = max(i for i, start in enumerate(starts) if start <= match.start())
    yield prose[index][0], " ".join(match.group(1).split())


def _stale(path: pathlib.Path, texts: Iterator[Tuple[int, str]],
           aliases: Dict[str, str]) -> List[str]:
  own = _own_modules()
  firsts = ["replicate"] + own + list(_FORMER) + list(aliases)
  problems = []
  for line, text in texts:
    for name in references(text, firsts):
      first, rest = name.split(".", 1)
      candidates = []
      if first in aliases:
        candidates.append(f"{aliases[first]}.{rest}")
      if first == "replicate" or first in own:
        candidates.append(name)
      missing = [resolve(c) for c in candidates]
      if not candidates:
        problem = f"{first} is no longer a module of the package"
      elif all(missing):
        problem = missing[-1]
      else:
        continue
      where = _relative(path)
      problems.append(f"{where}:{line}: `{name}`: {problem}")
  return problems


def _relative(path: pathlib.Path) -> pathlib.Path:
  """Where a file is, from the checkout or from the installed package's
  parent."""
  for root in (_ROOT, _PACKAGE.parent):
    if path.is_relative_to(root):
      return path.relative_to(root)
  return path


def _python_files() -> List[pathlib.Path]:
  return sorted(_PACKAGE.rglob("*.py"))


def _markdown_files() -> List[pathlib.Path]:
  files: List[pathlib.Path] = []
  for pattern in _DOCS:
    files.extend(sorted(_ROOT.glob(pattern)))
  return files


def test_docstrings_and_comments_name_what_exists():
  problems = []
  for path in _python_files():
    module = ".".join(path.relative_to(_PACKAGE.parent).with_suffix("").parts)
    aliases = _import_aliases(ast.parse(path.read_text()), module)
    problems += _stale(path, _python_texts(path), aliases)
  assert not problems, "Stale names:\n" + "\n".join(problems)


def test_docs_name_what_exists():
  files = _markdown_files()
  assert any(f.name == "README.md" for f in files)
  problems = []
  for path in files:
    problems += _stale(path, _markdown_texts(path), {})
  assert not problems, "Stale names:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("see `_batch.row_kinds`.", ["_batch.row_kinds"]),
        ("(`_meet.rewiring.Rewiring.advance`)",
         ["_meet.rewiring.Rewiring.advance"]),
        ("`replicate._tf` and replicate.testing.",
         ["replicate._tf", "replicate.testing"]),
        ("replicate/_tf.py, `_tf.py`, tests/_batch/test_x.py", []),
        ("self._batch.x, tf._tf.x, my_batch.x, `_batchy.x`", []),
        ("`_tf` alone, replicate alone", []),
    ],
)
def test_references_found(text, expected):
  assert references(text, ["replicate"] + _own_modules()) == expected


def test_resolve():
  assert resolve("_batch.row_kinds.SHARD") is None
  assert resolve("replicate.testing.assert_replicates") is None
  assert resolve("_context.Replication.shared_copies") is None
  assert resolve("_batch.kinds") == "no replicate._batch.kinds"
  assert resolve("_tf.NoSuchThing") == "no replicate._tf.NoSuchThing"
