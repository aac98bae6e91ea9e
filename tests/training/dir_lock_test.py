"""The output directory's lock: one holder at a time, named in the refusal; stale locks taken over; always released."""

import os
import signal
import subprocess
import sys
import time

import pytest

import tests
from training.runner import dir_lock


def test_a_second_lock_on_the_directory_fails_naming_it_and_the_holders_pid(tmp_path):
  directory = str(tmp_path / 'run')
  with dir_lock.DirectoryLock(directory) as lock:
    assert lock.held and os.path.exists(os.path.join(directory, dir_lock.LOCK_FILE))
    # flock locks belong to the open file: a second holder in the same process is refused too.
    with pytest.raises(dir_lock.DirectoryLockedError) as raised:
      dir_lock.DirectoryLock(directory).acquire()
    assert directory in str(raised.value) and f'pid {os.getpid()}' in str(raised.value)
    with dir_lock.DirectoryLock(str(tmp_path / 'other')):  # Other directories do not block each other.
      pass
  assert not os.path.exists(os.path.join(directory, dir_lock.LOCK_FILE))
  with dir_lock.DirectoryLock(directory) as again:  # Released: taken again, not stale.
    assert again.stale_holder is None


def test_released_on_every_exit_path_and_created_directories_removed(tmp_path):
  directory = tmp_path / 'new' / 'run'
  for error in (RuntimeError, KeyboardInterrupt):
    with pytest.raises(error):
      with dir_lock.DirectoryLock(str(directory)):
        assert directory.is_dir()
        raise error()
    assert not (tmp_path / 'new').exists()  # Created for the lock only, and left empty: removed again.
  with dir_lock.DirectoryLock(str(directory)):
    (directory / 'config.json').write_text('{}')
  assert sorted(os.listdir(directory)) == ['config.json']  # A directory that holds something stays.


_HOLD = '''
import sys, time
from training.runner import dir_lock
lock = dir_lock.DirectoryLock(sys.argv[1]).acquire()
print('held', flush=True)
time.sleep(120)
'''


def _hold_in_child(directory):
  child = subprocess.Popen([sys.executable, '-c', _HOLD, directory], cwd=tests.ROOT, stdout=subprocess.PIPE,
                           text=True)
  assert child.stdout.readline().strip() == 'held'
  return child


def test_a_lock_held_by_another_process_names_its_pid_and_a_killed_holders_lock_is_taken_over(tmp_path):
  directory = str(tmp_path / 'run')
  child = _hold_in_child(directory)
  try:
    with pytest.raises(dir_lock.DirectoryLockedError, match=f'{directory} is in use by another run \\(pid '
                       f'{child.pid}'):
      dir_lock.DirectoryLock(directory).acquire()
  finally:
    child.send_signal(signal.SIGKILL)  # Dies without releasing: the lock file stays, the flock goes.
    child.wait()
  assert os.path.exists(os.path.join(directory, dir_lock.LOCK_FILE))
  with dir_lock.DirectoryLock(directory) as lock:
    assert lock.stale_holder == f'pid {child.pid}'


def test_a_lock_file_of_a_dead_pid_is_stale(tmp_path):
  dead = subprocess.Popen(['true'])
  dead.wait()
  (tmp_path / dir_lock.LOCK_FILE).write_text(f'pid={dead.pid}\n')
  start = time.monotonic()
  with dir_lock.DirectoryLock(str(tmp_path)) as lock:
    assert lock.stale_holder == f'pid {dead.pid}'
    assert (tmp_path / dir_lock.LOCK_FILE).read_text().startswith(f'pid={os.getpid()}\n')
  assert time.monotonic() - start < 5


def test_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
  with dir_lock.DirectoryLock(str(tmp_path / 'run')):
    os.remove(tmp_path / 'run' / dir_lock.LOCK_FILE)  # Someone else's cleanup.
    with pytest.raises(dir_lock.DirectoryLockedError, match='is in use by another run'):
      dir_lock.DirectoryLock(str(tmp_path / 'run')).acquire()
  with dir_lock.DirectoryLock(str(tmp_path / 'run')):  # Released: free again.
    pass


def test_a_lock_file_planted_as_a_symbolic_link_is_refused_not_written_through(tmp_path):
  victim = tmp_path / 'victim'
  victim.write_text('precious')
  (tmp_path / 'run').mkdir()
  os.symlink(victim, tmp_path / 'run' / dir_lock.LOCK_FILE)
  with pytest.raises(dir_lock.DirectoryLockedError, match='is a symbolic link'):
    dir_lock.DirectoryLock(str(tmp_path / 'run')).acquire()
  assert victim.read_text() == 'precious'
