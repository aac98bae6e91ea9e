"""What a kill costs a run: at most `--checkpoint_every` rounds, at any moment; the resumed run ends as the
uninterrupted one, to the last byte of metrics.csv and the last bit of the model."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tests
from training import config as config_lib
from training.runner import checkpoints
from training.runner import experiment

# Rounds far quicker than their saves: work queued without a bound falls further behind each round.
_FLAGS = ['--model=logistic', '--num_clients=4', '--clients_per_round=3', '--batch_size=32', '--seed=3']


class _Runner:
  """`python -m training.run` in its own session, its output (the progress bar) in a file: TFF's worker may keep a
  pipe open after the runner is gone, and the session is what `stop` kills."""

  def __init__(self, tmp_path, out, flags, name):
    self.log = tmp_path / f'{name}.log'
    with open(self.log, 'w') as f:
      self.process = subprocess.Popen(
          [sys.executable, '-m', 'training.run', f'--output_dir={out}', *_FLAGS, *flags], cwd=tests.ROOT,
          stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))

  def reported(self) -> int:
    """The last round the progress bar reported done (0 before any)."""
    return max((int(r) for r in re.findall(r'\bround\s+(\d+)/', self.log.read_text())), default=0)

  def wait_for_round(self, round_num: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while self.reported() < round_num:
      assert self.process.poll() is None, self.log.read_text()[-3000:]
      assert time.monotonic() < deadline, f'round {round_num} was not reported: {self.log.read_text()[-3000:]}'
      time.sleep(0.02)

  def stop(self, sig: int = signal.SIGKILL) -> int:
    """Sends `sig` to the runner (SIGKILL: to its whole session at once, as the kernel's OOM killer or a lost
    machine would), waits for it, then kills what is left of its session. Returns its exit status."""
    try:
      if sig == signal.SIGKILL:
        _kill_session(self.process.pid)
      else:
        self.process.send_signal(sig)
      return self.process.wait(timeout=120)
    finally:
      _kill_session(self.process.pid)
      self.process.wait()


def _kill_session(pid: int) -> None:
  try:
    os.killpg(pid, signal.SIGKILL)
  except ProcessLookupError:  # Already gone, worker and all.
    pass


def _metrics_rounds(out) -> list[int]:
  path = out / 'metrics.csv'
  if not path.exists():
    return []
  return [int(float(line.split(',')[0])) for line in path.read_text().splitlines()[1:] if line]


def _checkpoint_tensors(out, round_num: int) -> dict[str, np.ndarray]:
  path = os.path.join(checkpoints.checkpoint_dir(str(out)), f'program_state_{round_num}', 'variables', 'variables')
  reader = tf.train.load_checkpoint(path)
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _assert_within_bound(runner: _Runner, out, every: int) -> None:
  """The newest checkpoint, and the rows, reach within `every` rounds of what the bar said was done."""
  reported = runner.reported()  # Read after the signal: what the bar had said done by then.
  saved = max(checkpoints.saved_rounds(str(out)), default=0)
  assert saved >= reported - every, f'the bar said round {reported} was done; the newest checkpoint is {saved}'
  assert max(_metrics_rounds(out), default=0) >= reported - every
  said = re.findall(r'interrupted after round (\d+) of', runner.log.read_text())
  assert said in ([], [str(saved)]), said  # The line names what was saved.


@pytest.mark.slow
def test_killed_late_then_terminated_a_run_loses_at_most_checkpoint_every_rounds_and_resumes_exactly(tmp_path):
  rounds, every = 60, 2
  flags = [f'--rounds={rounds}', f'--checkpoint_every={every}']
  resumed = tmp_path / 'resumed'
  # SIGKILL late in the run (work queued without a bound is then the furthest behind), SIGTERM after the resume.
  for name, sig, at in (('killed', signal.SIGKILL, 36), ('terminated', signal.SIGTERM, 48)):
    runner = _Runner(tmp_path, resumed, flags, name)
    try:
      runner.wait_for_round(at)
    finally:
      status = runner.stop(sig)
    assert status != 0, runner.log.read_text()[-3000:]  # It was still running: 60 quick rounds take far longer.
    _assert_within_bound(runner, resumed, every)
  final = _Runner(tmp_path, resumed, flags, 'final')
  try:
    assert final.process.wait(timeout=400) == 0, final.log.read_text()[-3000:]
  finally:
    final.stop()
  whole = tmp_path / 'whole'
  experiment.run(config_lib.ExperimentConfig(
      model='logistic', num_clients=4, clients_per_round=3, batch_size=32, seed=3, rounds=rounds,
      checkpoint_every=every, output_dir=str(whole)), show_progress=False)
  assert (resumed / 'metrics.csv').read_bytes() == (whole / 'metrics.csv').read_bytes()
  expected, got = _checkpoint_tensors(whole, rounds), _checkpoint_tensors(resumed, rounds)
  assert sorted(got) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
