"""Deadlines on the runner's calls into its TFF workers: a stopped, killed or silent worker ends the run in one line
naming its address and the round, with nothing past the last checkpoint; the resumed run ends byte for byte as an
uninterrupted one."""

import os
import re
import signal
import socket
import threading
import time

import psutil
import pytest
import tensorflow_federated as tff

from tests.training import loss_bound_test
from training import config as config_lib
from training.runner import checkpoints
from training.runner import experiment
from training.runner import worker_deadline

_SHORT = ['--first_round_deadline_s=120', '--round_deadline_factor=2', '--min_round_deadline_s=3']
_SETTINGS = worker_deadline.DeadlineSettings(first_s=60.0, factor=4.0, floor_s=2.0)


def test_the_first_call_gets_its_own_bound_and_later_ones_a_multiple_of_the_slowest():
  assert _SETTINGS.seconds(None) == 60.0
  assert _SETTINGS.seconds(0.1) == 2.0  # The floor.
  assert _SETTINGS.seconds(3.0) == 12.0
  assert worker_deadline.DeadlineSettings(0.0, 4.0, 2.0).seconds(3.0) is None  # 0: no deadline.


class _SilentListener:
  """A TCP listener that accepts connections and never answers (as a stopped process's kernel backlog does)."""

  def __init__(self):
    self.socket = socket.create_server(('127.0.0.1', 0))
    self.target = f'127.0.0.1:{self.socket.getsockname()[1]}'
    self.accepted = []
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      try:
        self.accepted.append(self.socket.accept()[0])
      except OSError:
        return

  def close(self):
    self.socket.close()
    for conn in self.accepted:
      conn.close()


def test_a_call_past_its_deadline_names_the_silent_worker_and_the_call():
  silent = _SilentListener()
  release = threading.Event()
  try:
    deadline = worker_deadline.WorkerDeadline(worker_deadline.DeadlineSettings(0.5, 2.0, 0.5),
                                              lambda: [silent.target])
    began = time.monotonic()
    with pytest.raises(worker_deadline.WorkerUnresponsive,
                       match=rf'^round 4: the TFF worker at {silent.target} does not answer within 0.5s \('):
      deadline.call('round 4', release.wait)
    assert time.monotonic() - began < 0.5 + worker_deadline.PROBE_S + 2
    assert silent.accepted  # The probe reached it.
  finally:
    release.set()
    silent.close()


def test_a_call_past_its_deadline_on_workers_that_answer_says_they_did_not_finish_it():
  from concurrent import futures  # pylint: disable=g-import-not-at-top
  import grpc  # pylint: disable=g-import-not-at-top
  server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # Completes the handshake; serves nothing.
  target = f'127.0.0.1:{server.add_insecure_port("127.0.0.1:0")}'
  server.start()
  release = threading.Event()
  try:
    for targets, said in (([target], f'{target} \\(they answer a connection'), ([], "the TFF context's workers")):
      deadline = worker_deadline.WorkerDeadline(worker_deadline.DeadlineSettings(0.2, 2.0, 0.2), lambda: targets)
      with pytest.raises(worker_deadline.WorkerUnresponsive,
                         match=rf'^round 2: not finished by {said}'):
        deadline.call('round 2', release.wait)
  finally:
    release.set()
    server.stop(None)


def test_a_call_in_time_returns_its_value_or_raises_its_error_and_runs_in_the_callers_tff_context():
  deadline = worker_deadline.WorkerDeadline(_SETTINGS, lambda: [])
  context = tff.framework.get_context_stack().current
  assert deadline.call('round 1', lambda: tff.framework.get_context_stack().current) is context
  assert deadline.slowest is not None
  with pytest.raises(ZeroDivisionError):
    deadline.call('round 2', lambda: 1 / 0)


def _worker_binaries(pid: int) -> list[psutil.Process]:
  # The C++ worker itself, not the confinement helper that starts it and forwards to it.
  return [p for p in psutil.Process(pid).children(recursive=True)
          if p.cmdline() and os.path.basename(p.cmdline()[0]) == 'worker_binary']


def _rounds_done(out) -> int:
  return max(checkpoints.saved_rounds(str(out)), default=0)


def _ended_in_one_line(runner, within: float) -> str:
  """The runner's exit (status 1, within `within` seconds): its error line, checked to be the only one."""
  assert runner.process.wait(timeout=within) == 1, runner.log.read_text()[-3000:]
  text = runner.log.read_text()
  assert 'Traceback' not in text, text[-3000:]
  errors = [line for line in text.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, text[-3000:]
  return errors[0]


def _finish(tmp_path, out, flags, name) -> None:
  runner = loss_bound_test._Runner(tmp_path, out, flags, name)
  try:
    assert runner.process.wait(timeout=400) == 0, runner.log.read_text()[-3000:]
  finally:
    runner.stop()


def _uninterrupted(out, rounds: int, **settings) -> bytes:
  experiment.run(config_lib.ExperimentConfig(
      model='logistic', num_clients=4, clients_per_round=3, batch_size=32, seed=3, rounds=rounds,
      checkpoint_every=2, output_dir=str(out), **settings), show_progress=False)
  return (out / 'metrics.csv').read_bytes()


@pytest.mark.slow
def test_a_stopped_runner_worker_ends_the_run_naming_it_and_a_resume_ends_as_an_uninterrupted_run(tmp_path):
  flags = ['--rounds=8', '--checkpoint_every=2', *_SHORT]
  out = tmp_path / 'run'
  runner = loss_bound_test._Runner(tmp_path, out, flags, 'stopped')
  try:
    runner.wait_for_round(3)
    (worker,) = _worker_binaries(runner.process.pid)
    worker.suspend()
    line = _ended_in_one_line(runner, within=60 + worker_deadline.PROBE_S)
    assert re.search(r'round [4-8]: the TFF worker at \S+ does not answer within \d+s', line), line
    saved = _rounds_done(out)
    assert 2 <= saved < 8 and max(loss_bound_test._metrics_rounds(out)) == saved  # Nothing past the checkpoint.
  finally:
    runner.stop()
  _finish(tmp_path, out, flags, 'resumed')
  assert (out / 'metrics.csv').read_bytes() == _uninterrupted(tmp_path / 'whole', 8)


def _worker_flags(workers) -> list[str]:
  return ['--rounds=8', '--checkpoint_every=2', f'--workers={",".join(w.target for w in workers)}', *_SHORT]


def _stopped_at(tmp_path, out, workers, name, at_round, sig) -> str:
  """A run on `workers`, `sig` sent to the second worker once round `at_round` is done: the run's error line."""
  runner = loss_bound_test._Runner(tmp_path, out, _worker_flags(workers), name)
  try:
    runner.wait_for_round(at_round)
    os.kill(workers[1].pid, sig)
    line = _ended_in_one_line(runner, within=60 + 2 * worker_deadline.PROBE_S)
  finally:
    runner.stop()
  assert max(loss_bound_test._metrics_rounds(out)) == _rounds_done(out)  # Nothing past the checkpoint.
  return line


@pytest.mark.slow
def test_a_stopped_or_killed_one_of_several_workers_ends_the_run_naming_it_and_a_resume_ends_as_uninterrupted(
    tmp_path):
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top
  workers = runtime.start_local_workers(2)
  try:
    whole = _uninterrupted(tmp_path / 'whole', 8, workers=','.join(w.target for w in workers))
    out = tmp_path / 'run'
    stopped = workers[1].target
    line = _stopped_at(tmp_path, out, workers, 'stopped', 3, signal.SIGSTOP)
    assert re.search(rf'round [4-8]: the TFF worker at {re.escape(stopped)} does not answer', line), line
    os.kill(workers[1].pid, signal.SIGCONT)
    line = _stopped_at(tmp_path, out, workers, 'killed', _rounds_done(out) + 1, signal.SIGKILL)
    assert re.search(rf'round [4-8]: the TFF worker at {re.escape(stopped)} does not answer', line), line
    assert _rounds_done(out) < 8
    workers[1].start()  # Back (at a new address).
    _finish(tmp_path, out, _worker_flags(workers), 'resumed')
  finally:
    runtime.set_simulation_context()
    for w in workers:
      w.stop()
  assert (out / 'metrics.csv').read_bytes() == whole
