"""The linter: `python -m ruff check` passes on the whole tree with the configuration in pyproject.toml.

Plain pytest, no TensorFlow: ruff (pinned in requirements.txt) reads the source only. The configuration's rules
(pyproject.toml [tool.ruff]) include E501 at 120 columns; a test here checks that a 121-column line fails, so that the
rule cannot drop out of the configuration unnoticed, and one that the files checked are the project's Python files.

Fast tier: ruff checks the tree in about a second. The subprocess runs in `_ruff`, outside the test functions, whose
source conftest.py reads to put tests that start processes in the slow tier (those are trainings and workers).
"""

import os
import subprocess
import sys

import pytest

import tests

_CONFIG = os.path.join(tests.ROOT, 'pyproject.toml')


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: these checks run the linter only (no TFF worker here)."""
  yield None


def _ruff(*args: str, cwd: str = tests.ROOT) -> subprocess.CompletedProcess:
  """`python -m ruff check --config pyproject.toml ARGS` with this interpreter's ruff, no cache written."""
  return subprocess.run([sys.executable, '-m', 'ruff', 'check', '--config', _CONFIG, '--no-cache', *args], cwd=cwd,
                        capture_output=True, text=True, timeout=300)


def test_the_tree_passes_ruff():
  process = _ruff('--output-format=concise')
  assert process.returncode == 0, (
      f'ruff check failed (exit {process.returncode}); fix the code, or see pyproject.toml [tool.ruff]:\n'
      f'{process.stdout}{process.stderr}')


def test_ruff_checks_the_projects_python_files_and_not_the_generated_ones():
  process = _ruff('--show-files')
  assert process.returncode == 0, process.stderr
  files = {os.path.relpath(line.strip(), tests.ROOT) for line in process.stdout.splitlines() if line.strip()}
  for expected in ('setup.py', 'tff_gma/__init__.py', 'tff_gma/aggregators/gradient_masked.py', 'training/run.py',
                   'tests/lint_test.py', 'examples/federated_digits.py'):
    assert expected in files, f'ruff does not check {expected}'
  top = {f.split(os.sep)[0] for f in files}
  assert top <= {'setup.py', 'pyproject.toml', 'tff_gma', 'training', 'tests', 'examples'}, sorted(top)


@pytest.mark.parametrize('columns, fails', [(120, False), (121, True)])
def test_a_line_over_120_columns_fails(tmp_path, columns, fails):
  code = "VALUE = '" + 'x' * (columns - len("VALUE = ''")) + "'\n"
  assert len(code.rstrip('\n')) == columns
  (tmp_path / 'module.py').write_text('"""A module."""\n\n\ndef f():\n  return 1\n\n\n' + code)
  process = _ruff('--output-format=concise', 'module.py', cwd=str(tmp_path))
  assert (process.returncode, 'E501' in process.stdout) == ((1, True) if fails else (0, False)), (
      process.stdout + process.stderr)
