"""Test helper: run a Python child as a background job of a non-interactive shell, as `nohup python x.py &` or a
script's `python x.py &` starts it (SIGINT and SIGQUIT ignored, inherited by whatever it starts), and see whether
it ends once its work is done.

The job's output goes to files, not pipes: a process the child leaves behind (TFF's orphaned worker inherits the
child's stdout/stderr) cannot keep the test waiting. `Job.cleanup` kills whatever is left of the job's process
group, and any pid the test names, by pid.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from tests.tff_gma import processes

DONE = 'DONE'  # The child prints `DONE <time.time()>` last, once its work is done.


@dataclasses.dataclass
class Job:
  """A finished (or given up) background job."""
  shell: subprocess.Popen
  stdout: str
  stderr: str
  exit_delay_s: Optional[float]  # Seconds from the child's DONE line to the job's end; None: it did not end.

  @property
  def returncode(self) -> Optional[int]:
    return self.shell.returncode

  def marked(self, marker: str) -> str:
    """The rest of the child's first stdout line that starts with `marker`."""
    return next(line for line in self.stdout.splitlines() if line.startswith(marker + ' '))[len(marker) + 1:]

  def cleanup(self, pids=()) -> list[int]:
    """Kills what is left: the job's process group (the shell, the child, a worker TFF started in it) and `pids`.
    Returns the pids among `pids` that were still alive."""
    left = [pid for pid in pids if processes.alive(pid)]
    try:
      os.killpg(self.shell.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    for pid in left:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.shell.wait()
    for pid in pids:
      assert processes.wait_gone(pid, 10.0), f'process {pid} is still alive after SIGKILL'
    return left


def ignored_signals(pid: int) -> set[int]:
  """The signals `pid` ignores (SigIgn in /proc/PID/status)."""
  with open(f'/proc/{pid}/status') as f:
    mask = int(next(line for line in f if line.startswith('SigIgn:')).split()[1], 16)
  return {n for n in range(1, 65) if mask & (1 << (n - 1))}


def run_background_job(code: str, directory: str, cwd: str, env: dict[str, str], exit_bound_s: float = 20.0,
                       timeout_s: float = 240.0) -> Job:
  """Runs `python -c CODE` as `bash -c 'python -c CODE & wait'`; returns once the job ended, or `exit_bound_s`
  after the child printed its DONE line (or `timeout_s` in all) if it did not (`exit_delay_s` None)."""
  out_path, err_path = os.path.join(directory, 'job.out'), os.path.join(directory, 'job.err')
  with open(out_path, 'wb') as out, open(err_path, 'wb') as err:
    shell = subprocess.Popen(['bash', '-c', '"$@" & wait', 'bash', sys.executable, '-c', code], cwd=cwd, env=env,
                             stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
  start = time.monotonic()
  done_at = None  # time.time() the child printed with DONE.
  exit_delay = None
  while True:
    if shell.poll() is not None:
      ended = time.time()
      if done_at is None:
        done_at = _done_time(out_path)
      exit_delay = None if done_at is None else max(0.0, ended - done_at)
      break
    if done_at is None:
      done_at = _done_time(out_path)
    if (done_at is not None and time.time() - done_at > exit_bound_s) or time.monotonic() - start > timeout_s:
      break
    time.sleep(0.05)
  with open(out_path) as f:
    stdout = f.read()
  with open(err_path) as f:
    stderr = f.read()
  return Job(shell, stdout, stderr, exit_delay)


def _done_time(path: str) -> Optional[float]:
  with open(path) as f:
    for line in f:
      if line.startswith(DONE + ' ') and line.endswith('\n'):
        return float(line.split()[1])
  return None
