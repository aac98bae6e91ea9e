"""The runner's command line: invalid flags end in one message and a non-zero exit, with nothing written; a run
holds its directory; Ctrl-C ends in one line with the command that resumes."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tests
from training.runner import dir_lock


def _run(tmp_path, *flags):
  return subprocess.run(
      [sys.executable, '-m', 'training.run', f'--output_dir={tmp_path / "out"}', '--rounds=1', *flags],
      cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'))


@pytest.mark.slow
@pytest.mark.parametrize('flags, named', [
    (['--aggregator=mean', '--secure'], 'secure_bound'),
    (['--algorithm=personalized', '--aggregator=elastic'], 'aggregator'),
    (['--seed=-1'], 'seed'),
    (['--seed=1099511627776'], 'seed'),  # 2**40: refused before anything is written (Keras' seed is 32-bit).
    (['--client_lr=inf'], 'client_lr'),
    (['--proximal_strength=nan'], 'proximal_strength'),
    (['--adaptive_epsilon=inf'], 'adaptive_epsilon'),
    (['--algorithm=scaffold', '--corruption=omniscient', '--corrupt_fraction=0.2'], 'corruption'),
])
def test_invalid_flags_end_in_one_message_and_write_nothing(tmp_path, flags, named):
  process = _run(tmp_path, *flags)
  assert process.returncode != 0
  assert 'invalid flags: ' in process.stderr and named in process.stderr, process.stderr[-2000:]
  assert 'Traceback' not in process.stderr + process.stdout, process.stderr[-3000:]
  # The message alone, not the command's help before it (TensorFlow's own start-up warnings aside).
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert len(lines) == 1 and lines[0].startswith('invalid flags: '), process.stderr[-3000:]
  assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_a_refused_start_then_the_corrected_command_runs(tmp_path):
  refused = _run(tmp_path, '--model=logistic', '--seed=-1')
  assert refused.returncode != 0 and 'invalid flags: ' in refused.stderr and 'seed' in refused.stderr
  assert not (tmp_path / 'out').exists()
  corrected = _run(tmp_path, '--model=logistic', '--seed=1')
  assert corrected.returncode == 0, corrected.stderr[-3000:]
  assert json.loads((tmp_path / 'out' / 'summary.json').read_text())['rounds_completed'] == 1


_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
# `python -m training.run` as a terminal's foreground command starts it: SIGINT at its default, so that Ctrl-C reaches
# it even when this suite itself runs as a background job (which starts with SIGINT ignored, inherited by what it
# starts: there a run rightly ignores Ctrl-C). The exec keeps the pid, which the lock's message names.
_FOREGROUND_RUNNER = [sys.executable, '-c', 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); '
                      'os.execv(sys.executable, [sys.executable, "-m", "training.run", *sys.argv[1:]])']


def _wait_for(path, process, timeout=240):
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    assert process.poll() is None, process.communicate()[1][-3000:]
    assert time.monotonic() < deadline, f'{path} did not appear'
    time.sleep(0.05)


@pytest.mark.slow
def test_a_second_run_is_refused_and_ctrl_c_says_how_to_resume(tmp_path):
  out = tmp_path / 'out'
  flags = [f'--output_dir={out}', '--rounds=8', '--model=logistic', '--num_clients=4', '--clients_per_round=3',
           '--eval_every=4', '--checkpoint_every=1']
  first = subprocess.Popen([*_FOREGROUND_RUNNER, *flags], cwd=tests.ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=_ENV)
  try:
    _wait_for(out / 'checkpoints' / 'program_state_2', first)
    first.send_signal(signal.SIGSTOP)  # Paused (still holding the directory) while the second one starts up.
    # The same command again, while the first is in the middle of its run: refused, naming the directory and the
    # holder, before any training.
    second = subprocess.run([sys.executable, '-m', 'training.run', *flags], cwd=tests.ROOT, capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL, env=_ENV)
    assert second.returncode == 1
    assert f'{out} is in use by another run (pid {first.pid}' in second.stderr, second.stderr[-3000:]
    assert 'Traceback' not in second.stderr
    first.send_signal(signal.SIGINT)  # Ctrl-C, delivered as it continues.
    first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=120)
  finally:
    if first.poll() is None:
      first.send_signal(signal.SIGCONT)
      first.kill()
      first.wait()
  assert first.returncode == 130, stderr[-3000:]
  assert 'Traceback' not in stderr + stdout, stderr[-3000:]
  (line,) = [s for s in stderr.splitlines() if s.strip()]
  done = max(int(name.rpartition('_')[2]) for name in os.listdir(out / 'checkpoints')
             if name.startswith('program_state_') and name.rpartition('_')[2].isdigit())
  assert 2 <= done < 8
  assert line == f'interrupted after round {done} of 8; resume with: python -m training.run ' + ' '.join(
      shlex.quote(f) for f in flags), line
  assert not (out / dir_lock.LOCK_FILE).exists()

  command = shlex.split(line.partition('resume with: ')[2])
  assert command[:3] == ['python', '-m', 'training.run']
  resumed = subprocess.run([sys.executable, *command[1:]], cwd=tests.ROOT, capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL, env=_ENV)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert json.loads((out / 'summary.json').read_text())['rounds_completed'] == 8
  with open(out / 'metrics.csv') as f:
    assert [row.split(',')[0] for row in f.read().splitlines()[1:]] == [str(r) for r in range(1, 9)]


@pytest.mark.slow
def test_an_unreachable_worker_is_a_flag_error_naming_the_address(tmp_path):
  process = _run(tmp_path, '--workers=127.0.0.1:1', '--aggregator=mean')
  assert process.returncode != 0
  assert 'invalid flags: workers:' in process.stderr and '127.0.0.1:1' in process.stderr, process.stderr[-2000:]
  assert 'Traceback' not in process.stderr
  assert not (tmp_path / 'out' / 'config.json').exists()


@pytest.mark.slow
def test_sigterm_says_how_to_resume_and_exits_143(tmp_path):
  out = tmp_path / 'out'
  # Far more rounds than the signal takes to arrive: 8 logistic rounds could all finish between the poll that sees
  # round 2's checkpoint and the signal (seen once, on a loaded machine: exit 0).
  flags = [f'--output_dir={out}', '--rounds=500', '--model=logistic', '--num_clients=4', '--clients_per_round=3',
           '--checkpoint_every=1']
  process = subprocess.Popen([sys.executable, '-m', 'training.run', *flags], cwd=tests.ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=_ENV)
  try:
    _wait_for(out / 'checkpoints' / 'program_state_2', process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  assert process.returncode == 143, stderr[-3000:]
  assert 'Traceback' not in stderr + stdout, stderr[-3000:]
  (line,) = [s for s in stderr.splitlines() if s.strip()]
  assert line.startswith('interrupted after round ') and line.endswith(
      'resume with: python -m training.run ' + ' '.join(shlex.quote(f) for f in flags)), line
  assert not (out / dir_lock.LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize('env, message', [
    ({'TFF_GMA_WORKER_LOG': 'FIFO'}, 'is not a regular file'),
    ({'TFF_GMA_WORKER_LOG': 'LINK'}, 'is a symbolic link; refusing to follow it'),
    ({'TFF_GMA_WORKER_CONFINEMENT': 'sometimes'}, "TFF_GMA_WORKER_CONFINEMENT='sometimes': expected one of"),
])
def test_a_refused_worker_setting_is_one_line_and_does_not_hang(tmp_path, env, message):
  if env.get('TFF_GMA_WORKER_LOG') == 'FIFO':
    os.mkfifo(tmp_path / 'log.fifo')  # Opening it for writing would wait for a reader forever.
    env = {'TFF_GMA_WORKER_LOG': str(tmp_path / 'log.fifo')}
  if env.get('TFF_GMA_WORKER_LOG') == 'LINK':
    (tmp_path / 'victim').write_text('precious')
    os.symlink(tmp_path / 'victim', tmp_path / 'worker.log')  # A link planted where the log goes.
    env = {'TFF_GMA_WORKER_LOG': str(tmp_path / 'worker.log')}
  process = subprocess.run(
      [sys.executable, '-m', 'training.run', f'--output_dir={tmp_path / "out"}', '--rounds=1', '--model=logistic'],
      cwd=tests.ROOT, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
      env=dict(_ENV, **env))
  assert process.returncode == 1, process.stderr[-3000:]
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert len(lines) == 1 and lines[0].startswith('error: ') and message in lines[0], process.stderr[-3000:]
  assert not (tmp_path / 'out').exists()
  if (tmp_path / 'victim').exists():
    assert (tmp_path / 'victim').read_text() == 'precious'


@pytest.mark.slow
@pytest.mark.parametrize('flags, message', [
    (['--output_dir={file}'], 'invalid flags: output_dir {file} is a file, not a directory'),
    (['--output_dir={file}/sub'], 'invalid flags: output_dir {file}/sub: {file} is a file, not a directory'),
    (['--output_dir='], 'invalid flags: output_dir is empty'),
    (['--num_clients=5000', '--clients_per_round=10'],
     'invalid flags: num_clients=5000 exceeds the number of examples'),
    (['--partition=label_skew', '--classes_per_client=11'],
     'invalid flags: classes_per_client must be an integer in [1, 10]'),
    (['--alpha=inf', '--partition=dirichlet'], 'invalid flags: alpha must be finite'),
    # A directory the kernel will not let anyone create: the failure of a write under the run.
    (['--output_dir=/proc/tff_gma_test_run'], 'error: No such file or directory: /proc/tff_gma_test_run (stopped '
     'before round 1 of 1 completed); fix it, then resume with: python -m training.run'),
], ids=['file', 'under_file', 'empty', 'too_many_clients', 'too_many_classes', 'alpha_inf', 'unwritable'])
def test_user_errors_are_one_line(tmp_path, flags, message):
  afile = tmp_path / 'afile'
  afile.write_text('')
  flags = [f.format(file=afile) for f in flags]
  process = subprocess.run(
      [sys.executable, '-m', 'training.run', '--rounds=1', '--model=logistic',
       *([] if any(f.startswith('--output_dir') for f in flags) else [f'--output_dir={tmp_path / "out"}']), *flags],
      cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=_ENV)
  assert process.returncode == 1, process.stderr[-3000:]
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert len(lines) == 1 and lines[0].startswith(message.format(file=afile)), process.stderr[-3000:]
  assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_a_run_whose_model_cannot_move_stops_in_one_line_naming_the_aggregator(tmp_path):
  # Every client's update overflows at this learning rate and GMA drops them all: its update is a finite zero, round
  # after round, so the model never moves (no non-finite update for the other stop to see).
  process = _run(tmp_path, '--rounds=8', '--model=logistic', '--num_clients=4', '--clients_per_round=3',
                 '--aggregator=gma', '--client_lr=1e38', '--max_frozen_rounds=3', '--checkpoint_every=2')
  assert process.returncode == 1, process.stderr[-3000:]
  assert 'Traceback' not in process.stderr + process.stdout, process.stderr[-3000:]
  # The round loop's own warnings (every client dropped) come first; the stop is the one line of the error.
  errors = [line for line in process.stderr.splitlines() if line.startswith('error:')]
  assert errors == [process.stderr.strip().splitlines()[-1]], process.stderr[-3000:]
  assert errors[0].startswith("error: stopped after round 3 of 8: the model has not changed for 3 rounds (rounds 1-3) "
                              "with aggregator 'gma': every client was dropped as non-finite"), errors
  out = tmp_path / 'out'
  summary = json.loads((out / 'summary.json').read_text())
  assert summary['stopped'] == errors[0][len('error: '):] and summary['rounds_completed'] == 2
  with open(out / 'metrics.csv') as f:
    assert [row.split(',')[0] for row in f.read().splitlines()[1:]] == ['1', '2']
  assert not (out / dir_lock.LOCK_FILE).exists()


# ----------------------------------------------------------------------------------------------------------------
# --seeds: one run per seed into <output_dir>/seed_<s>, resumable, and training.compare groups them.

def test_seeds_make_one_config_per_seed_and_refuse_bad_values(tmp_path):
  from absl import app  # pylint: disable=g-import-not-at-top
  from training import config as config_lib  # pylint: disable=g-import-not-at-top
  from training import run  # pylint: disable=g-import-not-at-top
  base = config_lib.ExperimentConfig(output_dir=str(tmp_path / 'out'), rounds=3)
  assert run.seed_configs(base, None, False) == [base]
  configs = run.seed_configs(base, ['2', '0', '7'], False)
  assert [(c.seed, c.output_dir) for c in configs] == [(s, str(tmp_path / 'out' / f'seed_{s}')) for s in (2, 0, 7)]
  assert all(c.rounds == 3 for c in configs)
  (tmp_path / 'single').mkdir()
  (tmp_path / 'single' / 'config.json').write_text('{}')
  for seeds, seed_given, output_dir, message in [
      (['0', 'x'], False, 'out', "invalid flags: seeds: 'x' is not an integer (e.g. --seeds=0,1,2)"),
      (['-1'], False, 'out', 'invalid flags: seeds: -1 is not in [0, 4294967295]'),
      (['1', '1'], False, 'out', 'invalid flags: seeds: 1 is given twice'),
      ([], False, 'out', 'invalid flags: seeds is empty (e.g. --seeds=0,1,2)'),
      (['0', '1'], True, 'out', 'invalid flags: seeds: give --seeds or --seed, not both'),
      (['0', '1'], False, 'single', f'invalid flags: seeds: {tmp_path}/single holds a single run (config.json)'),
  ]:
    config = config_lib.ExperimentConfig(output_dir=str(tmp_path / output_dir))
    with pytest.raises(app.UsageError) as raised:
      run.seed_configs(config, seeds, seed_given)
    assert str(raised.value).startswith(message), (seeds, str(raised.value))
  # Interrupted during one seed's run: the line names the seed.
  assert run.interrupted_message(configs[1], ['--seeds=2,0,7'], 3) == (
      'interrupted seed 0 (one of 3 seeds) before round 1 of 3 completed; resume with: python -m training.run '
      '--seeds=2,0,7')


@pytest.mark.slow
def test_an_invalid_seeds_value_is_one_line_and_writes_nothing(tmp_path):
  process = _run(tmp_path, '--model=logistic', '--seeds=0,one')
  assert process.returncode == 1, process.stderr[-3000:]
  lines = [line for line in process.stderr.splitlines() if line.strip() and 'TensorRT' not in line]
  assert lines == ["invalid flags: seeds: 'one' is not an integer (e.g. --seeds=0,1,2)"], process.stderr[-3000:]
  assert not (tmp_path / 'out').exists()


@pytest.mark.slow
def test_seeds_run_into_sibling_directories_resume_and_compare_groups_them(tmp_path):
  from training import compare  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'out'
  flags = [f'--output_dir={out}', '--seeds=0,1', '--dataset=digits', '--model=logistic', '--num_clients=4',
           '--clients_per_round=2']
  first = subprocess.run([sys.executable, '-m', 'training.run', *flags, '--rounds=1'], cwd=tests.ROOT,
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, env=_ENV)
  assert first.returncode == 0, first.stderr[-3000:]
  assert sorted(os.listdir(out)) == ['seed_0', 'seed_1']
  assert f'compare them with: python -m training.compare {out}' in first.stdout
  # The same command with more rounds continues each seed's run from its checkpoint.
  second = subprocess.run([sys.executable, '-m', 'training.run', *flags, '--rounds=2'], cwd=tests.ROOT,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, env=_ENV)
  assert second.returncode == 0, second.stderr[-3000:]
  summaries = {}
  for seed in (0, 1):
    summary = json.loads((out / f'seed_{seed}' / 'summary.json').read_text())
    assert summary['rounds_completed'] == 2 and summary['config']['seed'] == seed
    assert summary['config']['output_dir'] == str(out / f'seed_{seed}')
    with open(out / f'seed_{seed}' / 'metrics.csv') as f:
      assert [row.split(',')[0] for row in f.read().splitlines()[1:]] == ['1', '2']
    summaries[seed] = summary
  assert summaries[0]['final_accuracy'] != summaries[1]['final_accuracy']  # Two seeds, two runs.
  # compare reads the --seeds directory as one group of two runs.
  (group,) = compare.group_runs(compare.read_runs([str(out)]))
  assert group.seeds == [0, 1] and group.label == str(out)
  finals = [summaries[s]['final_accuracy'] for s in (0, 1)]
  process = subprocess.run([sys.executable, '-m', 'training.compare', str(out)], cwd=tests.ROOT,
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=_ENV)
  assert process.returncode == 0, process.stderr[-3000:]
  assert (f'| {out} | 2 | 0,1 | {100 * np.mean(finals):.2f} ± {100 * np.std(finals, ddof=1):.2f} |'
          in process.stdout), process.stdout
  assert (out / 'compare.png').is_file()


@pytest.mark.slow
def test_a_run_killed_by_sigkill_loses_at_most_checkpoint_every_rounds_and_resumes_bit_exactly(tmp_path):
  # The guarantee --checkpoint_every states: a run killed at any point (here by SIGKILL, no handler runs) resumes
  # from its newest checkpoint, trains the rounds after it again, and ends as the uninterrupted run.
  flags = ['--rounds=7', '--model=logistic', '--num_clients=4', '--clients_per_round=3', '--checkpoint_every=3']
  whole = subprocess.run([sys.executable, '-m', 'training.run', f'--output_dir={tmp_path / "whole"}', *flags],
                         cwd=tests.ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                         env=_ENV)
  assert whole.returncode == 0, whole.stderr[-3000:]
  out = tmp_path / 'killed'
  command = [sys.executable, '-m', 'training.run', f'--output_dir={out}', *flags]
  first = subprocess.Popen(command, cwd=tests.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           stdin=subprocess.DEVNULL, env=_ENV)
  try:
    _wait_for(out / 'checkpoints' / 'program_state_3', first)
    first.kill()
    first.communicate(timeout=60)
  finally:
    if first.poll() is None:
      first.kill()
      first.wait()
  with open(out / 'metrics.csv') as f:  # Written with the checkpoints: rounds 1-3, and some of 4-6 if the kill
    written = [int(row.split(',')[0]) for row in f.read().splitlines()[1:]]  # came while round 6's were written.
  assert written == list(range(1, len(written) + 1)) and 3 <= len(written) <= 6, written
  resumed = subprocess.run(command, cwd=tests.ROOT, capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL, env=_ENV)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert (out / 'metrics.csv').read_text() == (tmp_path / 'whole' / 'metrics.csv').read_text()
  summaries = [json.loads((d / 'summary.json').read_text()) for d in (out, tmp_path / 'whole')]
  assert summaries[0]['final_accuracy'] == summaries[1]['final_accuracy']
  assert summaries[0]['rounds_completed'] == 7


def test_a_sigterm_raised_inside_a_garbage_collection_callback_is_delivered_again():
  import gc  # pylint: disable=g-import-not-at-top
  from training import run  # pylint: disable=g-import-not-at-top
  sent = []

  def callback(phase, info):  # As JAX's: Python code that collections run. The signal lands in it, once.
    del phase, info
    if not sent:
      sent.append(True)
      os.kill(os.getpid(), signal.SIGTERM)
    began = time.monotonic()
    while time.monotonic() - began < 0.005:
      pass

  previous_handler, previous_hook = signal.signal(signal.SIGTERM, run._raise_terminated), sys.unraisablehook
  sys.unraisablehook = run._deliver_lost_stops(previous_hook)
  try:
    with pytest.raises(run._Terminated):
      gc.callbacks.append(callback)
      gc.collect()
      end = time.monotonic() + 5
      while time.monotonic() < end:
        pass
    assert sent
  finally:
    gc.callbacks.remove(callback)
    sys.unraisablehook = previous_hook
    signal.signal(signal.SIGTERM, previous_handler)
