"""The rounds' progress bar (`training.runner.progress`): tqdm's on a terminal, the same plain lines otherwise."""

import io
import os
import pty
import re
import select
import threading

import pytest
import tqdm

from training.runner import progress


@pytest.fixture(scope='module', autouse=True)
def simulation_context():
  """Overrides tests/conftest.py's fixture: the bar needs no TFF context."""
  yield None


class _Terminal(io.StringIO):

  def isatty(self):
    return True


def _no_monitor_thread():
  return not any(isinstance(t, tqdm.TMonitor) for t in threading.enumerate())


def test_off_a_terminal_a_plain_line_per_tenth_and_after_the_last_round():
  stream = io.StringIO()
  bar = progress.RoundProgress(20, 'fedavg/mean', stream=stream)
  for done in range(1, 21):
    bar.update(done, acc=done / 40)
  lines = stream.getvalue().splitlines()
  assert [int(re.search(r'round +(\d+)/20', line).group(1)) for line in lines] == [1, 2, 4, 6, 8, 10, 12, 14, 16,
                                                                                  18, 20]
  for line in lines:
    assert re.fullmatch(r'fedavg/mean    \[[#.]{30}\] round +\d+/20 acc \d\.\d{4} \( *\d+\.\ds\)', line), line
  assert lines[0].startswith('fedavg/mean    [##' + '.' * 28 + '] round    1/20 acc 0.0250 (')
  assert lines[-1].startswith('fedavg/mean    [' + '#' * 30 + '] round   20/20 acc 0.5000 (')
  assert 'fedavg/mean    [' + '#' * 15 + '.' * 15 + '] round   10/20 acc 0.2500 (' in stream.getvalue()


def test_without_metrics_the_plain_line_keeps_its_spaces():
  stream = io.StringIO()
  progress.RoundProgress(2, 'x', stream=stream).update(2)
  assert re.fullmatch(r'x {13} \[#{30}\] round    2/2  \( *\d+\.\ds\)\n', stream.getvalue())


def test_on_a_terminal_tqdms_bar_on_the_same_stream_and_no_monitor_thread():
  stream = _Terminal()
  bar = progress.RoundProgress(5, 'fedavg/mean', stream=stream)
  assert isinstance(bar._bar, tqdm.tqdm)  # pylint: disable=protected-access
  for done in range(1, 6):
    bar.update(done, acc=0.75)
  text = stream.getvalue()
  assert '\r' in text and text.endswith('\n')  # Redrawn in place, then left with a newline.
  last = text.rstrip('\n').split('\r')[-1]
  assert re.match(r'fedavg/mean: 100%\|.*\| 5/5 \[.*round.*, acc 0\.7500\]$', last), last
  assert '[#' not in text and 'round    5/5' not in text  # Not the plain lines.
  assert _no_monitor_thread()
  bar.update(5, acc=0.8)  # After the last round the bar is closed: nothing more is drawn.
  assert stream.getvalue() == text


def test_on_a_pseudo_terminal_tqdm_draws_the_bar():
  leader, follower = pty.openpty()
  with os.fdopen(follower, 'w') as terminal:
    bar = progress.RoundProgress(3, 'gma', stream=terminal)
    assert bar._bar is not None  # pylint: disable=protected-access
    for done in range(1, 4):
      bar.update(done, acc=0.5)
    terminal.flush()
    drawn = b''
    while select.select([leader], [], [], 0.5)[0]:
      drawn += os.read(leader, 65536)
  os.close(leader)
  text = drawn.decode()
  assert 'gma: 100%|' in text and '3/3' in text and 'acc 0.5000' in text, text
  assert '[#' not in text
  assert _no_monitor_thread()


def test_a_bar_closed_before_its_last_round_ends_its_line():
  stream = _Terminal()
  bar = progress.RoundProgress(10, 'fedavg/mean', stream=stream)
  bar.update(3)
  bar.close()
  assert stream.getvalue().endswith('\n') and '3/10' in stream.getvalue()
  plain = io.StringIO()
  progress.RoundProgress(10, stream=plain).close()  # Off a terminal: nothing to end.
  assert plain.getvalue() == ''
