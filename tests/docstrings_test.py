"""Every module of tff_gma/ and training/ has a docstring that opens with a one-line summary.

Plain pytest, no TensorFlow: it parses the source only. The summary is one sentence on one line, as TFF's, followed
by what a reader needs, at no fixed length. tff_gma's source points into no docs/ page (a pip install has none), and
training's pointers into docs/ (`docs/NAME.md#anchor`) must resolve."""

import ast
import os
import re

import pytest

from tests import docs_test

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('tff_gma', 'training')
MAX_SUMMARY_CHARS = 120  # The source's line length: the summary fits on the docstring's first line.
_DOCS_POINTER = re.compile(r'\bdocs/((?:[\w.-]+/)*[\w.-]+\.md)(?:#([\w-]+))?')
_ANY_DOCS_PATH = re.compile(r'\bdocs/(?:[\w./-]*[\w-](?:#[\w-]+)?)?')  # A page, a folder, or docs/ itself.
# tff_gma's docs/ pointers that stay, each with why: (path, pointer).
_LIBRARY_POINTERS_KEPT = {
    # The error's one line, asserted verbatim by tests/tff_gma/contexts_test.py and quoted in docs/runtime.md.
    ('tff_gma/_default_context.py', 'docs/runtime.md#troubleshooting'),
}


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
    return 'no module docstring (say what the module is for)'
  if not lines or not lines[0].strip():
    return 'the docstring must start with a one-sentence summary line'
  summary = lines[0].strip()
  if len(lines) > 1 and lines[1].strip():
    return 'the summary line must be followed by a blank line (a summary is one line)'
  if not summary.endswith('.'):
    return f'the summary line must be a sentence ending with a period: {summary!r}'
  if len(summary) > MAX_SUMMARY_CHARS:
    return f'a summary line of {len(summary)} characters (at most {MAX_SUMMARY_CHARS}): say it shorter'
  return None


@pytest.mark.parametrize('path', list(_params()))
def test_module_docstring_opens_with_a_summary(path):
  problem = docstring_problem(_read(path))
  assert problem is None, f'{path}: {problem}'


def library_docs_paths(path: str, source: str) -> list[str]:
  """The docs/ paths that `source` (the file `path` of tff_gma/) names, less `_LIBRARY_POINTERS_KEPT`."""
  return [found for found in _ANY_DOCS_PATH.findall(source) if (path, found) not in _LIBRARY_POINTERS_KEPT]


@pytest.mark.parametrize('path', python_files('tff_gma'))
def test_library_points_into_no_docs_page(path):
  # A pip user gets the package alone: a docstring, comment or message says the fact, not where docs/ has it.
  found = library_docs_paths(path, _read(path))
  assert not found, f'{path} points into docs/, which a pip install does not have: {found}'


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
    ('"""Summary."""\n', None),
    ('"""Summary.\n\n' + 'A line.\n' * 30 + '"""\n', None),
    ('"""Summary that runs on\nto a second line.\n"""\n', 'followed by a blank line'),
    ('"""A summary without its period\n\nMore.\n"""\n', 'ending with a period'),
    ('"""' + 'x' * MAX_SUMMARY_CHARS + '.\n"""\n', f'of {MAX_SUMMARY_CHARS + 1} characters'),
    ('"""\n\n"""\n', 'summary line'),
    ('import os\n', 'no module docstring'),
])
def test_docstring_problem(source, problem):
  found = docstring_problem(source)
  if problem is None:
    assert found is None, found
  else:
    assert found is not None and problem in found, found


@pytest.mark.parametrize('source, found', [
    ('"""Details: docs/methods.md#fedgma."""\n', ['docs/methods.md#fedgma']),
    ("# See docs/research/benchmark.md.\nx = 1\n", ['docs/research/benchmark.md']),
    ("raise ValueError('see docs/runtime.md')\n", ['docs/runtime.md']),
    ('"""No pointer: tff_gma.aggregators.composition."""\n', []),
])
def test_library_docs_paths(source, found):
  assert library_docs_paths('tff_gma/example.py', source) == found


def test_pointer_pattern_reads_pages_in_folders():
  assert _DOCS_POINTER.findall('see docs/research/benchmark.md#sections-keys-and-method') == [
      ('research/benchmark.md', 'sections-keys-and-method')]
  assert _DOCS_POINTER.findall('docs/runtime.md.') == [('runtime.md', '')]
