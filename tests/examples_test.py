"""The examples/ scripts a TFF user copies: the README's example is their code, and they run as documented.

* The README's code block under "Use it in your own TFF pipeline" is made of pieces of
  `examples/federated_digits.py`, verbatim: each piece between `# ...` lines appears in the script as consecutive
  lines (with one indentation added to all of them: the script runs them inside `main()`), in the README's order.
* The script runs in a subprocess, as a user would run it, and prints what it promises: both audits PASS, one line
  per round with finite training metrics, and a federated evaluation whose held-out accuracy rises and loss falls.
"""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
EXAMPLE = os.path.join(ROOT, 'examples', 'federated_digits.py')
README_SECTION = '## Use it in your own TFF pipeline'
ELISION = '# ...'
_NUMBER = r'(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf)'


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: the script runs its own TFF context in its own process."""
  yield None


def readme_example() -> str:
  with open(README, encoding='utf-8') as f:
    text = f.read()
  section = text[text.index(README_SECTION):]
  match = re.search(r'^```python\n(.*?)^```', section, flags=re.M | re.S)
  assert match, f'no python code block in the README section {README_SECTION!r}'
  return match.group(1)


def pieces(block: str) -> list[list[str]]:
  """The block's lines, split at the `# ...` lines (which are left out); blank lines around a piece dropped."""
  result, current = [], []
  for line in block.splitlines():
    if line.startswith(ELISION):
      result.append(current)
      current = []
    else:
      current.append(line.rstrip())
  result.append(current)
  trimmed = []
  for piece in result:
    while piece and not piece[0]:
      piece = piece[1:]
    while piece and not piece[-1]:
      piece = piece[:-1]
    if piece:
      trimmed.append(piece)
  return trimmed


def find_piece(piece: list[str], lines: list[str], start: int) -> int:
  """Index after the first occurrence, at or after `start`, of `piece` in `lines` with one added indentation."""
  first = piece[0]
  for i in range(start, len(lines) - len(piece) + 1):
    if not lines[i].endswith(first) or lines[i][:len(lines[i]) - len(first)].strip():
      continue
    indent = lines[i][:len(lines[i]) - len(first)]
    if all(lines[i + k] == (indent + line if line else '') for k, line in enumerate(piece)):
      return i + len(piece)
  return -1


def test_readme_example_is_the_example_scripts_code():
  with open(EXAMPLE, encoding='utf-8') as f:
    lines = [line.rstrip() for line in f.read().splitlines()]
  found = pieces(readme_example())
  assert len(found) >= 3, found
  position = 0
  for piece in found:
    end = find_piece(piece, lines, position)
    assert end >= 0, ('this part of the README example is not, verbatim and in order, in '
                      'examples/federated_digits.py:\n' + '\n'.join(piece))
    position = end


def test_piece_matching_detects_a_changed_line():
  lines = ['def main():', '  a = 1', '', '  b = 2']
  assert find_piece(['a = 1', '', 'b = 2'], lines, 0) == 4
  assert find_piece(['a = 1', '', 'b = 3'], lines, 0) == -1
  assert find_piece(['b = 2'], lines, 2) == 4 and find_piece(['a = 1'], lines, 2) == -1
  assert pieces('x\n# ... left out\n\ny\n\n# ...\n') == [['x'], ['y']]


def test_the_example_runs_passes_its_audits_and_learns():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  completed = subprocess.run([sys.executable, EXAMPLE], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=1500, check=False)
  out = completed.stdout
  assert completed.returncode == 0, f'stdout:\n{out}\nstderr (tail):\n{completed.stderr[-5000:]}'
  assert 'audit of the training round: PASS' in out, out
  assert 'audit of the evaluation round: PASS' in out, out
  rounds = re.findall(rf'^round (\d+)/(\d+): train loss {_NUMBER}, accuracy {_NUMBER}, '
                      rf'coordinates masked {_NUMBER}$', out, flags=re.M)
  assert rounds, out
  total = int(rounds[0][1])
  assert [int(r[0]) for r in rounds] == list(range(1, total + 1))
  for _, _, loss, accuracy, masked in rounds:
    assert math.isfinite(float(loss)) and 0 <= float(accuracy) <= 1 and 0 <= float(masked) <= 1
  (evaluation,) = re.findall(
      rf'^evaluation on 4 held-out clients: accuracy {_NUMBER} before training, {_NUMBER} after {total} rounds '
      rf'\(loss {_NUMBER} -> {_NUMBER}\)$', out, flags=re.M)
  before, after, loss_before, loss_after = map(float, evaluation)
  assert all(math.isfinite(v) for v in (before, after, loss_before, loss_after)), evaluation
  # From a random model (about chance, 0.1; loss near ln 10) to well above it in a few rounds.
  assert after > before + 0.1 and after > 0.3, evaluation
  assert loss_after < loss_before, evaluation
