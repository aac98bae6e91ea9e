"""Crash consistency: a run killed (SIGKILL or SIGTERM) at ten points, checkpoint writes among them, resumed each
time, and its TFF worker killed mid-round once, ends with the uninterrupted run's metrics.csv and model, byte for
byte. The guarantees and their limits: docs/experiments.md#crash-consistency-what-a-kill-costs"""

import os
import re
import signal
import time

import numpy as np
import psutil
import pytest

from tests.training import loss_bound_test
from training import config as config_lib
from training.runner import checkpoints
from training.runner import experiment

_ROUNDS, _EVERY = 20, 2
_RUN_FLAGS = [f'--rounds={_ROUNDS}', f'--checkpoint_every={_EVERY}']
# The runner's exit on SIGTERM (training/run.py), after the save in progress has finished and its workers stopped.
_TERMINATED_EXIT = 143
_PROMPT_S = 20.0


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The uninterrupted run (in this process: its bytes are the runner's, as loss_bound_test shows)."""
  whole = tmp_path_factory.mktemp('whole')
  experiment.run(config_lib.ExperimentConfig(
      model='logistic', num_clients=4, clients_per_round=3, batch_size=32, seed=3, rounds=_ROUNDS,
      checkpoint_every=_EVERY, output_dir=str(whole)), show_progress=False)
  return whole


def _entries(directory, pattern: str) -> list[str]:
  """The names in `directory` that match `pattern` in full ([] when it does not exist)."""
  try:
    return [n for n in os.listdir(directory) if re.fullmatch(pattern, n)]
  except FileNotFoundError:
    return []


def _partial_saves(out, round_num) -> list[str]:
  """What TFF's manager writes a checkpoint into before renaming it (`checkpoints.remove_partial_saves`)."""
  return _entries(checkpoints.checkpoint_dir(str(out)), f'{checkpoints.PREFIX}{round_num}_temp[0-9]+')


def _partial_releases(out) -> list[str]:
  """What TFF's CSV release writes metrics.csv into before renaming it (`checkpoints.remove_partial_releases`)."""
  return _entries(out, 'metrics.csv_temp[0-9]+')


def _wait_until(runner, condition, what: str, busy: bool = False, timeout: float = 240) -> None:
  """Polls `condition` while the runner lives; `busy` polls without sleeping, for windows of a few milliseconds."""
  deadline = time.monotonic() + timeout
  while not condition():
    assert runner.process.poll() is None, f'exited before {what}: {runner.log.read_text()[-3000:]}'
    assert time.monotonic() < deadline, f'no {what}: {runner.log.read_text()[-3000:]}'
    if not busy:
      time.sleep(0.005)


def _running(process: psutil.Process) -> bool:
  try:
    return process.status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def _stop(runner, sig: int) -> tuple[int, float]:
  """`runner.stop(sig)`, then every process the runner had started stopped too (a TFF worker outliving its runner
  is a failure, but not one to leave running). Returns the exit status and the seconds the runner took to exit."""
  if sig == signal.SIGKILL:
    # Frozen at once, as the SIGKILL would freeze it: listing its children takes milliseconds, longer than some of
    # the windows aimed at. No code of the runner runs in between.
    try:
      os.killpg(runner.process.pid, signal.SIGSTOP)
    except ProcessLookupError:
      pass
  try:
    descendants = psutil.Process(runner.process.pid).children(recursive=True)
  except psutil.NoSuchProcess:
    descendants = []
  began = time.monotonic()
  try:
    status = runner.stop(sig)
  finally:
    deadline = time.monotonic() + 10
    while any(_running(p) for p in descendants) and time.monotonic() < deadline:
      time.sleep(0.05)
    alive = [p for p in descendants if _running(p)]
    for process in alive:
      process.kill()
  assert not alive, f'outlived the runner: {alive}'
  return status, time.monotonic() - began


def _record_written(out, round_num) -> bool:
  return os.path.exists(checkpoints.record_path(str(out), round_num))


def _resumable(out) -> int:
  """The round a run resumes from: its newest checkpoint with a record (0: none, the run starts afresh)."""
  return max((r for r in checkpoints.saved_rounds(str(out)) if _record_written(out, r)), default=0)


def _first_reported(runner):
  """The first round the runner's progress bar reported (it reports a run's first round always), or None."""
  return min((int(r) for r in re.findall(r'\bround\s+(\d+)/', runner.log.read_text())), default=None)


def _final_checkpoint_bytes(out) -> dict[str, tuple[str, tuple, bytes]]:
  """The final checkpoint's tensors: dtype, shape and bytes of each."""
  tensors = loss_bound_test._checkpoint_tensors(out, _ROUNDS)  # pylint: disable=protected-access
  return {name: (a.dtype.str, a.shape, a.tobytes()) for name, a in ((n, np.asarray(v)) for n, v in tensors.items())}


def _assert_same_run(out, reference) -> None:
  assert (out / 'metrics.csv').read_bytes() == (reference / 'metrics.csv').read_bytes()
  got, expected = _final_checkpoint_bytes(out), _final_checkpoint_bytes(reference)
  assert sorted(got) == sorted(expected) and expected
  for name in expected:
    assert got[name] == expected[name], name


# Each kill point: a signal, and a wait, a function of the runner and the output directory, that returns where the
# signal is sent. For SIGKILL, `_landed` then reads where it landed off what the kill left.
def _at_round(round_num):
  def wait(runner, out):
    del out
    runner.wait_for_round(round_num)
    return f'after round {runner.reported()} was reported'
  return wait


def _in_partial_save(round_num):
  """While round `round_num`'s checkpoint is written (its temporary directory exists): a save lasts ~0.1 s here."""
  def wait(runner, out):
    _wait_until(runner, lambda: _partial_saves(out, round_num), f'partial save of round {round_num}')
    return f'writing checkpoint {round_num}'
  return wait


def _before_record(round_num):
  """After round `round_num`'s state is renamed into place, before its run record is written: a window of a few
  milliseconds, polled busily."""
  def wait(runner, out):
    _wait_until(runner, lambda: _partial_saves(out, round_num), f'partial save of round {round_num}')
    final = os.path.join(checkpoints.checkpoint_dir(str(out)), f'{checkpoints.PREFIX}{round_num}')
    _wait_until(runner, lambda: os.path.isdir(final), f'checkpoint {round_num}', busy=True)
    return f'before the record of checkpoint {round_num}'
  return wait


def _in_release(after_round, round_num):
  """While metrics.csv is rewritten for the rows up to round `round_num` (polled busily once `after_round` is
  reported), or had that ended unseen, while that round's checkpoint is written."""
  def wait(runner, out):
    runner.wait_for_round(after_round)
    _wait_until(runner, lambda: _partial_releases(out) or _partial_saves(out, round_num),
                f'release of round {round_num}', busy=True)
    return f'releasing metrics.csv for checkpoint {round_num}' if _partial_releases(out) else \
        f'writing checkpoint {round_num}'
  return wait


def _workers(runner) -> list[psutil.Process]:
  """The runner's TFF workers (under their confinement helper, where there is one)."""
  try:
    return [p for p in psutil.Process(runner.process.pid).children(recursive=True) if p.name() == 'worker_binary']
  except psutil.Error:  # The runner, or a child being listed, has just exited.
    return []


def _worker_killed_then_round(round_num):
  """The worker SIGKILLed as the run's first round is reported (the loop then starts the next one, which the kill
  interrupts); then, once a new worker serves the run, `_at_round(round_num)`."""
  def wait(runner, out):
    _wait_until(runner, lambda: runner.reported() > 0 and _workers(runner), 'a round on a worker')
    (worker,) = _workers(runner)
    worker.kill()
    killed_after = runner.reported()
    worker.wait(timeout=10)
    _wait_until(runner, lambda: [p for p in _workers(runner) if p.pid != worker.pid], 'a restarted worker')
    assert killed_after < round_num, killed_after  # The run went on past the kill, on the new worker.
    return f'{_at_round(round_num)(runner, out)}, its worker killed after round {killed_after}'
  return wait


def _in_plot(runner, out):
  """After summary.json, while accuracy.png is drawn (~0.7 s): the run's last step."""
  _wait_until(runner, lambda: (out / 'summary.json').exists(), 'summary.json')
  return 'drawing accuracy.png'


_KILL_POINTS = (
    (signal.SIGKILL, _in_partial_save(0)),  # The first start's save of the seeded initial state.
    (signal.SIGTERM, _at_round(1)),
    (signal.SIGKILL, _in_partial_save(4)),
    (signal.SIGTERM, _in_partial_save(6)),
    (signal.SIGKILL, _before_record(8)),
    (signal.SIGTERM, _at_round(9)),
    (signal.SIGKILL, _in_release(11, 12)),
    (signal.SIGTERM, _worker_killed_then_round(15)),
    (signal.SIGKILL, _in_partial_save(_ROUNDS)),  # The last checkpoint.
    (signal.SIGTERM, _in_plot),
)


def _landed(out, sig, where: str) -> str:
  """Where a SIGKILL landed, from what it left: a write's temporary entry stays, a checkpoint without its record
  stays without it. A SIGTERM lets the write in progress finish, so it leaves no such trace: `where` stands."""
  if sig != signal.SIGKILL:
    return where
  if where.startswith('writing checkpoint '):
    round_num = int(where.rpartition(' ')[2])
    return where if _partial_saves(out, round_num) else f'just after checkpoint {round_num}'
  if where.startswith('before the record of checkpoint '):
    round_num = int(where.rpartition(' ')[2])
    return where if not _record_written(out, round_num) else f'just after checkpoint {round_num} and its record'
  if where.startswith('releasing metrics.csv') and not _partial_releases(out):
    round_num = int(where.rpartition(' ')[2])
    if _partial_saves(out, round_num):
      return f'writing checkpoint {round_num}'
    if max(loss_bound_test._metrics_rounds(out), default=0) > _resumable(out):  # pylint: disable=protected-access
      return f'between metrics.csv and checkpoint {round_num}'
    # TFF's CSV release of a round first rewrites the file without the rows from that round on (through a
    # temporary file), then appends the round's row: a kill between the two leaves neither a partial release nor
    # rows ahead of the newest checkpoint.
    return f'between the rewrite and the append of a metrics.csv release for checkpoint {round_num}'
  return where


def _check_kill(runner, out, sig, status: int, seconds: float, where: str) -> None:
  """What the kill left: a run short of its end, whose newest checkpoint is within `--checkpoint_every` rounds of
  what it reported; SIGTERM: exit 143 within `_PROMPT_S` with the resume line, and no partial save left."""
  log = runner.log.read_text()
  if sig == signal.SIGKILL:
    assert status == -signal.SIGKILL, (where, status, log[-3000:])
  else:
    assert status == _TERMINATED_EXIT, (where, status, log[-3000:])
    assert seconds < _PROMPT_S, seconds
    assert re.search(r'^interrupted (after|before) round \d+ of \d+.*; resume with: python -m training\.run ', log,
                     re.MULTILINE), log[-3000:]
    assert not _entries(checkpoints.checkpoint_dir(str(out)), r'.*_temp[0-9]+'), 'SIGTERM left a partial save'
  saved = checkpoints.saved_rounds(str(out))
  loss_bound_test._assert_within_bound(runner, out, _EVERY)  # pylint: disable=protected-access
  if where == 'drawing accuracy.png':
    assert not (out / 'accuracy.png').exists(), log[-3000:]
  else:
    assert max(saved, default=0) < _ROUNDS or not _record_written(out, _ROUNDS), (where, saved)
  if where.startswith('between metrics.csv and checkpoint '):  # Rows ahead of the newest checkpoint: to be dropped.
    assert max(loss_bound_test._metrics_rounds(out)) > _resumable(out), where  # pylint: disable=protected-access
  if where.startswith('writing checkpoint '):
    round_num = int(where.rpartition(' ')[2])
    if sig == signal.SIGKILL:  # Killed inside TFF's write: its temporary directory stays, the checkpoint is absent.
      assert _partial_saves(out, round_num) and round_num not in saved, (where, saved)
    else:  # The save in progress finished, record included.
      assert round_num in saved and _record_written(out, round_num), (where, saved)


_IN_A_WRITE = ('writing checkpoint ', 'before the record of checkpoint ', 'releasing metrics.csv')


@pytest.mark.slow
def test_a_run_killed_at_ten_points_and_its_worker_once_ends_as_the_uninterrupted_one(tmp_path, reference):
  out = tmp_path / 'resumed'
  landed = []  # (signal, where it landed, the newest checkpoint after it, seconds to exit)
  for index, (sig, wait) in enumerate(_KILL_POINTS):
    first_round = _resumable(out) + 1
    runner = loss_bound_test._Runner(tmp_path, out, _RUN_FLAGS, f'run{index}')  # pylint: disable=protected-access
    try:
      where = wait(runner, out)
    finally:
      status, seconds = _stop(runner, sig)
    where = _landed(out, sig, where)
    _check_kill(runner, out, sig, status, seconds, where)
    assert _first_reported(runner) in (None, first_round), (where, _first_reported(runner), first_round)
    landed.append((signal.Signals(sig).name, where, max(checkpoints.saved_rounds(str(out)), default=None),
                   round(seconds, 2)))
  print('kill points (signal, where, newest checkpoint after it, seconds to exit):', *landed, sep='\n  ')
  assert sum(where.startswith(_IN_A_WRITE) for _, where, _, _ in landed) >= 3, landed
  final = loss_bound_test._Runner(tmp_path, out, _RUN_FLAGS, 'final')  # pylint: disable=protected-access
  try:
    assert final.process.wait(timeout=300) == 0, final.log.read_text()[-3000:]
  finally:
    _stop(final, signal.SIGKILL)
  assert final.reported() == 0, final.log.read_text()[-3000:]  # Resumed from the last round: none left to train.
  # The resumes saw what the kills left: each partial save removed, a checkpoint without its record skipped.
  logs = '\n'.join((tmp_path / f'{name}.log').read_text() for name in [f'run{i}' for i in range(1, 10)] + ['final'])
  partial = sum(sig == 'SIGKILL' and where.startswith('writing checkpoint ') for sig, where, _, _ in landed)
  assert logs.count('a checkpoint whose save never finished') == partial, logs[-5000:]
  if any(where.startswith('before the record') for _, where, _, _ in landed):
    assert f'no {checkpoints.RECORD_FILE}: its save never finished' in logs, logs[-5000:]
  if any(where.startswith('releasing metrics.csv') for _, where, _, _ in landed):
    assert 'a metrics.csv release that never finished' in logs, logs[-5000:]
  _assert_same_run(out, reference)
  assert (out / 'accuracy.png').exists()
