"""The code carries no history: no issue number or date in the source of tff_gma/ and training/.

Plain pytest, no TensorFlow: it reads the source only. Why a value or a rule is what it is belongs in the comment
beside it; which issue asked for it, and when, belong to the commit messages and the research record (docs/research/).
"""

import re

import pytest

from tests import docstrings_test

PACKAGES = docstrings_test.PACKAGES
HISTORY = {
    'an issue number': re.compile(r'[Ii]ssues? #?\d+|\(#\d+\)'),
    'a date': re.compile(r'20\d\d-\d\d-\d\d'),
}
# Source text that matches a pattern and is data, not history: (path, the matched text) -> why it stays.
ALLOWED: dict[tuple[str, str], str] = {}


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: these checks read source files only (no TFF worker here)."""
  yield None


def history_in(path: str, source: str) -> list[tuple[int, str, str]]:
  """(line number, what, the text) for each issue number or date in `source`, less `ALLOWED`."""
  return [(number, what, m.group(0))
          for number, line in enumerate(source.splitlines(), start=1)
          for what, pattern in HISTORY.items()
          for m in pattern.finditer(line) if (path, m.group(0)) not in ALLOWED]


@pytest.mark.parametrize('path', [path for package in PACKAGES for path in docstrings_test.python_files(package)])
def test_no_issue_number_or_date(path):
  with open(docstrings_test.ROOT + '/' + path, encoding='utf-8') as f:
    found = history_in(path, f.read())
  assert not found, ('say what the code does and why; the history goes to the commit message or docs/research/: '
                     + '; '.join(f'{path}:{number}: {what} {text!r}' for number, what, text in found))


@pytest.mark.parametrize('line, found', [
    ('# Issue 37\'s limits.', [('an issue number', 'Issue 37')]),
    ('"""Small rounds (issue 37): two sections."""', [('an issue number', 'issue 37')]),
    ('# Targets of issues #8 and 9.', [('an issue number', 'issues #8')]),
    ('x = 1  # Fixed in (#12).', [('an issue number', '(#12)')]),
    ('# The default became 1 (2026-11-24).', [('a date', '2026-11-24')]),
    ('# Reddi et al. 2021, Algorithm 2; Sec. 5.2; Table 9; 95% t intervals.', []),
    ('CHANNEL = 0x2026  # Not a date: 2026-1-5 either.', []),
])
def test_history_in(line, found):
  assert [(what, text) for _, what, text in history_in('x.py', line)] == found


def test_an_allowed_match_is_not_reported(monkeypatch):
  monkeypatch.setitem(ALLOWED, ('x.py', '2026-11-24'), 'data')
  assert history_in('x.py', "DATE = '2026-11-24'") == []
  assert history_in('y.py', "\nDATE = '2026-11-24'") == [(2, 'a date', '2026-11-24')]
