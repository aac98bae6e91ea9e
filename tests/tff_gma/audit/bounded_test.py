"""The audit is bounded: its walk takes time in the computation's size (a lambda called twice in the same place with
the same argument is replayed, its counts added as numbers), `--timeout` covers the analysis as well as the
loading, and a target's process that runs out of memory is reported as such, not as the audited code's doing."""

import os
import subprocess
import sys
import time

import pytest

from tests.tff_gma.audit import targets
from tests.tff_gma.audit.main_test import _in_process
from tests.tff_gma.audit.main_test import _messages
from tests.tff_gma.audit.main_test import _module
from tests.tff_gma.audit.main_test import _run_cli
from tff_gma import audit
from tff_gma.audit import __main__ as cli
from tff_gma.audit import isolation


def _flows(report):
  return sorted((f.intrinsic, f.count, f.aggregation_pass, f.where) for f in report.flows)


def test_a_chain_of_lambdas_each_calling_the_one_before_twice_audits_in_linear_time():
  start = time.monotonic()
  report = audit.audit_computation(targets.lambda_chain(30))
  elapsed = time.monotonic() - start
  assert _flows(report) == [('federated_mean', 2**30, 1, 'computation')]
  assert report.verdict == 'PASS'
  assert elapsed < 3, elapsed  # Enumerating the 2**30 runs took about 0.1 ms each.


def test_replayed_calls_count_each_site_as_often_as_it_runs():
  # Level k's sum runs once per run of level k: 2**(20 - k) times; the mean 2**20 times.
  report = audit.audit_computation(targets.lambda_chain(20, sum_per_level=True), timeout_s=10)
  assert _flows(report) == sorted(
      [('federated_mean', 2**20, 1, 'computation')] +
      [('federated_sum', 2**(20 - k), 1, 'computation') for k in range(1, 21)])
  assert report.verdict == 'FAIL'


def test_the_walk_stops_at_its_deadline():
  # 2**40 places of its own (see `lambda_chain`): no memo shortens it; the deadline does.
  block = targets.lambda_chain(40, block_bodies=True)
  start = time.monotonic()
  with pytest.raises(audit.AnalysisTimeout):
    audit.audit_computation(block, timeout_s=0.5)
  assert time.monotonic() - start < 3


def test_the_command_s_timeout_covers_the_analysis(capsys):
  start = time.monotonic()
  code = _in_process(['tests.tff_gma.audit.targets:lambda_chain_40_block_bodies', '--timeout=1'])
  assert time.monotonic() - start < 5
  assert code == cli.EXIT_ERROR
  assert _messages(capsys.readouterr().err) == [
      'error: the audit of tests.tff_gma.audit.targets:lambda_chain_40_block_bodies: the analysis of the target\'s '
      'computations did not finish within --timeout=1 s (loading and analysis together); no verdict']


@pytest.mark.slow
def test_the_command_audits_the_chain_within_its_timeout(tmp_path):
  # The analysis takes milliseconds; the minute is for loading TFF in both processes on a busy machine.
  process = _run_cli(tmp_path, 'tests.tff_gma.audit.targets:lambda_chain_30', '--timeout=60', '--format=json')
  assert process.returncode == cli.EXIT_OK, process.stderr
  assert '"count": 1073741824' in process.stdout


@pytest.mark.slow
def test_a_target_that_needs_more_memory_than_the_limit_is_out_of_memory_not_its_fault(tmp_path):
  process = _run_cli(tmp_path, 'hungry_target:computation', '--memory_limit=4',
                     extra_env=_module(tmp_path, 'hungry_target', 'data = bytearray(8 << 30)\n'))
  assert process.returncode == cli.EXIT_ERROR, process.stderr
  assert process.stdout == ''
  assert _messages(process.stderr) == [
      'error: the audit of hungry_target:computation ran out of memory while loading the target (the audit limits '
      'its process to 4 GiB of address space: --memory_limit); no verdict']


def test_a_child_killed_by_sigkill_after_using_most_of_its_memory_is_out_of_memory():
  # What the kernel's out-of-memory killer does to a process when the machine runs out before the limit; a plain
  # Python child (no TFF), the audit's own start and collection of it.
  # It lives a moment after allocating, as a process the killer picks does: the audit samples its own peak then (a
  # large parent's fork hides it from `ru_maxrss`, as pytest's does in the full suite).
  script = 'import os, signal, time\ndata = b"x" * (5 << 27)\ntime.sleep(1)\nos.kill(os.getpid(), signal.SIGKILL)\n'
  child = isolation.start_child(['-c', script], 60, memory_limit=1 << 30)
  with pytest.raises(isolation.CommandError) as error:
    isolation.collect(child, 'killed_target:computation')
  message = str(error.value)
  assert message.startswith('the audit of killed_target:computation ran out of memory: the target\'s process was '
                            'killed by SIGKILL after using 0.'), message
  assert message.endswith(' GiB (its limit: 1 GiB), most likely by the system\'s out-of-memory killer; no verdict')


def test_a_child_that_kills_itself_with_little_memory_is_still_its_own_doing():
  child = isolation.start_child(['-c', 'import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n'], 60,
                                memory_limit=1 << 30)
  with pytest.raises(isolation.CommandError, match=r'ended \(killed by signal SIGKILL\) .* the audited code ended'):
    isolation.collect(child, 'killed_target:computation')


def test_a_large_parents_memory_is_not_taken_for_the_childs(tmp_path):
  """Linux's `ru_maxrss` of a forked child starts at its parent's resident memory: from a 1 GiB parent (pytest grows
  past that in the full suite), a child that kills itself at once must still be its own doing, not out of memory."""
  script = tmp_path / 'big_parent.py'
  script.write_text(
      'import os, signal\n'
      'from tff_gma.audit import isolation\n'
      'ballast = b"y" * (1 << 30)\n'
      'child = isolation.start_child(["-c", "import os, signal\\nos.kill(os.getpid(), signal.SIGKILL)\\n"], 60,\n'
      '                              memory_limit=1 << 30)\n'
      'try:\n'
      '  isolation.collect(child, "killed_target:computation")\n'
      'except isolation.CommandError as e:\n'
      '  print(e)\n')
  output = tmp_path / 'output.txt'
  with open(output, 'w') as out:
    process = subprocess.run([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT, timeout=120,
                             cwd=os.getcwd(), start_new_session=True, check=False)
  text = output.read_text()
  assert process.returncode == 0, text
  assert 'the audited code ended' in text and 'out of memory' not in text, text
