"""Module docstrings say what and why in a few lines: every module of tff_gma/ and training/ has one, of at most 6.

Plain pytest, no TensorFlow: it parses the source only. The first line is a one-sentence summary, as TFF's; the
detail lives in class and function docstrings and in docs/, and the pointers there (`docs/NAME.md#anchor`) in
tff_gma's and training's source must resolve. Every module is checked strictly."""

import ast
import os
import re

import pytest

from tests import docs_test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('tff_gma', 'training')
MAX_LINES = 6
_DOCS_POINTER = re.compile(r'\bdocs/([\w.-]+\.md)(?:#([\w-]+))?')


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: these checks read source files only (no TFF worker here)."""
  yield None


def python_files(package: str) -> list[str]:
  """The .py files under `package` (relative to the repository root), sorted."""
  found = []
  for directory, subdirectories, files in os.walk(os.path.join(ROOT, package)):
    subdirectories[:] = sorted(d for d in subdirectories if d != '__pycache__')
    found.extend(os.path.relpath(os.path.join(directory, f), ROOT) for f in files if f.endswith('.py'))
  return sorted(found)


def module_docstring_lines(source: str):
  """The lines of a module's docstring (cleaned as `inspect.cleandoc` does), or None when it has none."""
  docstring = ast.get_docstring(ast.parse(source), clean=True)
  return None if docstring is None else docstring.splitlines()


def _read(path: str) -> str:
  with open(os.path.join(ROOT, path), encoding='utf-8') as f:
    return f.read()


def _params():
  for package in PACKAGES:
    for path in python_files(package):
      yield pytest.param(path, id=path)


def test_finds_the_modules():
  library = python_files('tff_gma')
  assert 'tff_gma/__init__.py' in library and 'tff_gma/aggregators/weiszfeld.py' in library, library
  assert python_files('training'), 'no module found under training/'


def docstring_problem(source: str):
  """What is wrong with the module docstring of `source`, in words; None when nothing is."""
  lines = module_docstring_lines(source)
  if lines is None:
    return 'no module docstring (say what the module is for, in a few lines)'
  if not lines or not lines[0].strip():
    return 'the docstring must start with a one-sentence summary line'
  if len(lines) > 1 and lines[1].strip():
    return 'the summary line must be followed by a blank line'
  if len(lines) > MAX_LINES:
    return (f'a module docstring of {len(lines)} lines (at most {MAX_LINES}): keep what and why, move the detail '
            'into the class and function docstrings, the method-level explanations into docs/methods.md (audit.md, '
            'runtime.md) and the measurements into the doc that reports them')
  return None


@pytest.mark.parametrize('path', list(_params()))
def test_module_docstring_is_short(path):
  problem = docstring_problem(_read(path))
  assert problem is None, f'{path}: {problem}'


def _source_pointers():
  for path in (path for package in PACKAGES for path in python_files(package)):
    for number, line in enumerate(_read(path).splitlines(), start=1):
      for name, anchor in _DOCS_POINTER.findall(line):
        yield pytest.param(name, anchor, id=f'{path}:{number}:docs/{name}{"#" + anchor if anchor else ""}')


@pytest.mark.parametrize('name, anchor', list(_source_pointers()))
def test_pointer_into_docs_resolves(name, anchor):
  target = os.path.join(ROOT, 'docs', name)
  assert os.path.isfile(target), f'docs/{name} does not exist'
  if anchor:
    available = docs_test.anchors(target)
    assert anchor in available, f'docs/{name} has no heading with anchor #{anchor} (its anchors: {sorted(available)})'


# --- The checker itself. ---------------------------------------------------------------------------------------


@pytest.mark.parametrize('source, expected', [
    ('"""One line."""\n', ['One line.']),
    ('"""Summary.\n\n  Why, in two\n  lines.\n  """\nx = 1\n', ['Summary.', '', 'Why, in two', 'lines.']),
    ('# A comment, then code.\nx = 1\n', None),
    ('x = 1\n"""Not the module\'s docstring."""\n', None),
    ('', None),
])
def test_module_docstring_lines(source, expected):
  assert module_docstring_lines(source) == expected


@pytest.mark.parametrize('source, problem', [
    ('"""Summary.\n\n' + 'A line.\n' * (MAX_LINES - 2) + '"""\n', None),
    ('"""Summary.\n\n' + 'A line.\n' * (MAX_LINES - 1) + '"""\n', 'of 7 lines (at most 6)'),
    ('"""Summary that runs on\nto a second line.\n"""\n', 'followed by a blank line'),
    ('"""\n\n"""\n', 'summary line'),
    ('import os\n', 'no module docstring'),
])
def test_docstring_problem(source, problem):
  found = docstring_problem(source)
  if problem is None:
    assert found is None, found
  else:
    assert found is not None and problem in found, found
