"""Resource faults under the commands, for real (rlimits, paths changed under a run, a read-only mount): one line
naming the cause or the path, no traceback, and a log named only where it still exists.

Each child runs in a session of its own, its output in files (a TFF worker left behind would hold a pipe open),
and what is left of that session is killed at the end.
"""

import errno
import os
import re
import subprocess
import sys

import pytest

import tests
from tests.tff_gma import processes
from tests.training import mounts
from training import safe_files

_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
_TINY = ['--rounds=3', '--model=logistic', '--num_clients=3', '--clients_per_round=2', '--checkpoint_every=1']
_TF_LOG_LINE = re.compile(r'^\S+ \d\d:\d\d:\d\d\.\d+: [IWEF] \S+\] ')

# The process's own address space once TFF is imported, read before a limit is set just above it.
_VM_SIZE = '''
def vm_size():
  for line in open('/proc/self/status'):
    if line.startswith('VmSize:'):
      return int(line.split()[1]) << 10
'''

# A command whose worker cannot start its threads: every thread of a process started from here reserves 1 GiB of
# stack (glibc reads RLIMIT_STACK when a program starts), in 400 MiB more address space than this process has.
_STARVED_WORKER = _VM_SIZE + '''
import resource, runpy, sys
import tensorflow_federated
resource.setrlimit(resource.RLIMIT_STACK, (1 << 30, resource.RLIM_INFINITY))
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (400 << 20), resource.RLIM_INFINITY))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
'''

# A command whose thread cannot start: the address space limited to 1 MiB above its use (a thread's stack is 8).
# Its exit allocates, as a finalizer may, and fails at the limit: what that prints must not follow the one line.
_NO_THREAD = _VM_SIZE + '''
import atexit, resource, threading
from training import command_line
atexit.register(lambda: bytearray(64 << 20))

def main(argv):
  resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (1 << 20), resource.RLIM_INFINITY))
  threading.Thread(target=lambda: None).start()

command_line.run(main)
'''

# `python -m training.run` with the output paths changed after round 1 (as a user's `mv` or `rm` would).
_CHANGED_UNDER_THE_RUN = '''
import os, runpy, shutil, sys
from training.runner import experiment
change = sys.argv.pop(1)

def after_round(output_dir, round_num, state):
  if round_num == 1 and change == 'checkpoints_a_file':
    shutil.rmtree(os.path.join(output_dir, 'checkpoints'))
    open(os.path.join(output_dir, 'checkpoints'), 'w').close()
  elif round_num == 1 and change == 'output_dir_moved':
    os.rename(output_dir, output_dir + '.moved')

run = experiment.run
experiment.run = lambda config, **kwargs: run(
    config, on_round=lambda *args: after_round(config.output_dir, *args), **kwargs)
sys.argv[0] = 'training.run'
runpy.run_module('training.run', run_name='__main__', alter_sys=True)
'''


def _run(tmp_path, argv, timeout=300, env=None) -> tuple[int, list[str]]:
  """Runs `argv` in its own session; (exit code, stderr's lines less TF's own log lines and the progress bar)."""
  out_path, err_path = tmp_path / 'child.stdout', tmp_path / 'child.stderr'
  with open(out_path, 'w') as out, open(err_path, 'w') as err:
    process = subprocess.Popen(argv, cwd=tests.ROOT, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                               start_new_session=True, env=env or _ENV)
  try:
    code = process.wait(timeout=timeout)
  finally:
    processes.kill_session(process.pid)
    process.wait()
  stderr = err_path.read_text()
  assert 'Traceback' not in stderr, stderr[-3000:]
  return code, [line for line in stderr.splitlines()
                if line.strip() and not _TF_LOG_LINE.match(line) and not line.startswith('fedavg/mean ')]


@pytest.mark.slow
def test_a_thread_that_cannot_start_is_one_line_naming_the_limits(tmp_path):
  code, lines = _run(tmp_path, [sys.executable, '-c', _NO_THREAD])
  assert code == 1 and len(lines) == 1, lines
  assert lines[0].startswith("error: cannot start a thread (the process's thread or address-space limit: "
                             'ulimit -u / -v'), lines


@pytest.mark.slow
@pytest.mark.parametrize('module, flags', [
    ('training.run', [*_TINY, '--output_dir={tmp}/run']),
    ('tff_gma.worker', ['--port=0', '--bind=127.0.0.1', '--log_path={tmp}/worker.log']),
], ids=['runner', 'worker'])
def test_a_worker_that_cannot_start_threads_is_one_line_naming_a_log_that_outlives_the_command(
    tmp_path, module, flags):
  argv = [sys.executable, '-c', _STARVED_WORKER, module, *[f.format(tmp=tmp_path) for f in flags]]
  env = {key: value for key, value in _ENV.items() if key != 'TFF_GMA_WORKER_LOG'}  # The default log.
  code, lines = _run(tmp_path, argv, env=env)
  assert code == 1 and len(lines) == 1, lines
  line = lines[0]
  # Found by the confinement helper at the worker's start, or by its own exit (128 + 6) just after.
  assert re.match(r'error: the TFF worker (on \S+ )?did not start: .*exited with code (-6|134) \(SIGABRT\)', line), line
  assert "it could not start a thread (the process's thread or address-space limit: ulimit -u / -v)" in line, line
  log = line.rpartition('; log: ')[2]
  assert os.path.isfile(log), line  # Still there after the command's exit, for the user to read.
  if module == 'training.run':
    os.remove(log)  # Out of the private directory, which the command removed: not the test's to leave.
    assert not os.path.exists(tmp_path / 'run' / 'config.json')  # Nothing written.


@pytest.mark.slow
@pytest.mark.parametrize('change, message', [
    # Found by the save (TensorFlow's error) or by the check of the checkpoints before it, whichever comes first.
    ('checkpoints_a_file', r'error: (Not a directory: {out}/checkpoints \(stopped after round |'
                           r'{out}/checkpoints is not a directory: )'),
    ('output_dir_moved', r'error: the output directory was moved or removed during the run: {out} \(stopped with '
                         r'its output directory gone\)'),
], ids=['checkpoints_a_file', 'output_dir_moved'])
def test_output_paths_changed_under_the_run_are_one_line_naming_the_path(tmp_path, change, message):
  out = tmp_path / 'run'
  code, lines = _run(tmp_path, [sys.executable, '-c', _CHANGED_UNDER_THE_RUN, change, *_TINY,
                                f'--output_dir={out}'])
  assert code == 1 and len(lines) == 1, lines
  assert re.match(message.format(out=re.escape(str(out))), lines[0]), lines


def test_a_worker_start_out_of_threads_names_the_limits(tmp_path):
  from tff_gma import runtime  # pylint: disable=g-import-not-at-top

  def no_thread(out):
    raise RuntimeError("can't start new thread")

  worker = runtime.WorkerProcess(log_path=str(tmp_path / 'worker.log'))
  worker._start_confined = worker._start_unconfined = no_thread  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match=r"^the TFF worker did not start: this process cannot start a thread "
                                         r"\(the process's thread or address-space limit: ulimit -u / -v\)$"):
    worker.start()


def _op_error(message):
  return type('OpError', (Exception,), {'message': message})()


def test_a_directory_replaced_by_a_file_under_tensorflow_is_an_os_error():
  error = safe_files.os_error_of(_op_error('/run/checkpoints is not a directory'))
  assert (error.errno, error.filename) == (errno.ENOTDIR, '/run/checkpoints')


def test_a_checkpoint_out_of_descriptors_names_the_path_alone():
  """What `ulimit -n 20` gives a run's first checkpoint: the file's path, not the function TensorFlow ran."""
  error = safe_files.os_error_of(_op_error(
      '{{function_node __wrapped__SaveV2_dtypes_6_device_/job:localhost/replica:0/task:0/device:CPU:0}} '
      '/run/checkpoints/program_state_0_temp1/variables/part-0.tempstate1; Too many open files [Op:SaveV2]'))
  path = '/run/checkpoints/program_state_0_temp1/variables/part-0.tempstate1'
  assert (error.errno, error.filename) == (errno.EMFILE, path)


# The run's directory made read-only under the lock (a read-only bind mount over it, which open files do not
# block): the write that fails is the error reported, not the lock file's removal that fails after it.
_READ_ONLY_UNDER_THE_LOCK = '''
import os, subprocess
from training.runner import dir_lock
directory = os.path.join(os.environ['MNT'], 'run')
try:
  with dir_lock.DirectoryLock(directory):
    subprocess.run(['mount', '--bind', directory, directory], check=True)
    subprocess.run(['mount', '-o', 'remount,bind,ro', directory], check=True)
    open(os.path.join(directory, 'metrics.csv'), 'w')
except OSError as e:
  print('raised:', e.filename, e.strerror)
'''


@pytest.mark.slow
def test_a_lock_that_cannot_be_removed_does_not_replace_the_error_that_ended_the_run(tmp_path):
  mounts.require()
  mnt = tmp_path / 'mnt'
  script = f'{sys.executable} -c "$SCRIPT"'
  process = mounts.run_on_tmpfs(mnt, script, env=dict(_ENV, SCRIPT=_READ_ONLY_UNDER_THE_LOCK), cwd=tests.ROOT)
  assert process.returncode == 0, process.stderr[-3000:]
  assert f'raised: {mnt}/run/metrics.csv Read-only file system' in process.stdout, process.stderr[-3000:]


@pytest.mark.slow
def test_a_run_out_of_file_descriptors_is_one_line_naming_the_limit(tmp_path):
  out = tmp_path / 'run'
  command = ' '.join([sys.executable, '-m', 'training.run', *_TINY, f'--output_dir={out}'])
  code, lines = _run(tmp_path, ['bash', '-c', f'ulimit -n 20 && exec {command}'])
  assert code == 1 and len(lines) == 1, lines
  assert re.fullmatch(r"error: Too many open files \(this process's open-file limit: ulimit -n\): \S+ \(stopped "
                      r'.*\); fix it, then resume with: .*', lines[0]), lines
