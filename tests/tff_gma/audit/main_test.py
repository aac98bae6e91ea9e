"""Tests for `python -m tff_gma.audit`: exit status, output formats, options, and no leftover TFF worker."""

import tests
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_federated as tff

from tff_gma.audit import __main__ as cli

_REPO = tests.ROOT


def _run_python(argv, tmp_path):
  """Runs `python ARGV` in its own session; fails (after killing them) if any process it started outlives it.

  Output goes to files, not pipes: a leftover TFF worker inherits its parent's stdout/stderr, and reading a pipe
  to its end would wait for the worker instead of reporting it.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  stdout_path, stderr_path = tmp_path / 'stdout', tmp_path / 'stderr'
  with open(stdout_path, 'w') as stdout, open(stderr_path, 'w') as stderr:
    process = subprocess.Popen([sys.executable, *argv], cwd=_REPO, env=env, stdout=stdout, stderr=stderr,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
      process.wait(timeout=300)
    finally:
      # The child led a new process group: anything of it still alive (a TFF worker would be) answers signal 0.
      leftover = True
      try:
        os.killpg(process.pid, 0)
      except ProcessLookupError:
        leftover = False
      if leftover:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
  assert not leftover, f'processes started by {argv} outlived it (killed now)'
  return subprocess.CompletedProcess(argv, process.returncode, stdout_path.read_text(), stderr_path.read_text())


def _run_cli(tmp_path, *args):
  return _run_python(['-m', 'tff_gma.audit', *args], tmp_path)


def test_clean_computation_exits_zero_and_prints_the_report(tmp_path):
  process = _run_cli(tmp_path, 'tests.tff_gma.audit.targets:weighted_mean')
  assert process.returncode == 0, process.stderr
  assert '## Aggregation audit: tests.tff_gma.audit.targets:weighted_mean (computation)' in process.stdout
  assert '**Verdict: PASS.**' in process.stdout
  assert '| 1 | `federated_weighted_mean` | `{float32[3]}@CLIENTS` | no | - | 1 | yes |' in process.stdout


def test_leaky_factory_exits_nonzero_and_writes_json(tmp_path):
  output = tmp_path / 'audit.json'
  process = _run_cli(tmp_path, 'tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'float32[3]', '--format', 'json',
                     '--output', str(output))
  assert process.returncode == 1, process.stderr
  report = json.loads(process.stdout)
  assert json.loads(output.read_text()) == report
  assert report['ok'] is False
  assert [v['intrinsic'] for v in report['violations']] == ['federated_sum']
  assert report['subject'] == 'tests.tff_gma.audit.targets:plain_sum_factory (SumFactory.create(float32[3]))'


# In-process `main` (no subprocess start-up): options and errors. `tests/` is on sys.path under pytest.


def test_policy_options(capsys):
  assert cli.main(['tests.tff_gma.audit.targets:plain_sum']) == cli.EXIT_VIOLATIONS
  assert cli.main(['tests.tff_gma.audit.targets:plain_sum', '--policy', 'allow-plain-sum']) == cli.EXIT_OK
  assert cli.main(['tests.tff_gma.audit.targets:client_max', '--policy', 'allow-plain-sum']) == cli.EXIT_VIOLATIONS
  assert cli.main(['tests.tff_gma.audit.targets:client_max', '--allow', 'federated_max']) == cli.EXIT_OK
  assert 'FAIL' in capsys.readouterr().out


def test_builder_callable_and_weight_type(capsys):
  code = cli.main(['tests.tff_gma.audit.targets:secure_mean_factory', '--value_type', 'float32[3]', '--weight_type', 'float32'])
  assert code == cli.EXIT_OK
  out = capsys.readouterr().out
  assert 'MeanFactory.create(float32[3], float32)' in out
  assert 'bitwidth=32' in out


def test_rfa_report_shows_one_pass_per_weiszfeld_pass(capsys):
  # audit_targets.secure_rfa: the project's secure RFA with R = 2 passes, so 2 client-to-server rounds.
  assert cli.main(['tests.tff_gma.audit.targets:secure_rfa', '--value_type', 'float32[3]']) == cli.EXIT_OK
  out = capsys.readouterr().out
  assert 'Client-to-server aggregation passes per call of `next`: **2**.' in out
  assert '**Verdict: PASS.**' in out


@pytest.mark.parametrize('argv, message', [
    (['no_colon_here'], 'MODULE:ATTR'),
    (['tests.tff_gma.audit.targets:no_such_target'], 'AttributeError'),
    (['no_such_module_xyz:target'], 'ModuleNotFoundError'),
    (['tests.tff_gma.audit.targets:plain_sum_factory'], 'value_type is required'),
    (['tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'float32[x]'], 'bad dimension'),
    (['tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'notadtype[3]'], 'unknown dtype'),
])
def test_errors_exit_two(capsys, argv, message):
  assert cli.main(argv) == cli.EXIT_USAGE
  assert message in capsys.readouterr().err


@pytest.mark.parametrize('spec, expected', [
    ('float32', tff.TensorType(np.float32)),
    ('int32[3]', tff.TensorType(np.int32, [3])),
    ('float64[2, ?]', tff.TensorType(np.float64, [2, None])),
    ('tests.tff_gma.audit.targets:VALUE', tff.TensorType(np.float32, [3])),
    (None, None),
])
def test_parse_type(spec, expected):
  assert cli.parse_type(spec) == expected
