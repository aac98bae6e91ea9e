"""Tests for `python -m tff_gma.audit`: exit status, output formats, options, and no leftover TFF worker."""

import tests
import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow_federated as tff

from tests.tff_gma import processes
from tff_gma.audit import __main__ as cli

_REPO = tests.ROOT


def _run_python(argv, tmp_path, extra_env=None):
  """Runs `python ARGV` in its own session; fails (after killing them) if any process it started outlives it.

  Output goes to files, not pipes: a leftover TFF worker inherits its parent's stdout/stderr, and reading a pipe
  to its end would wait for the worker instead of reporting it.
  """
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', **(extra_env or {}))
  stdout_path, stderr_path = tmp_path / 'stdout', tmp_path / 'stderr'
  with open(stdout_path, 'w') as stdout, open(stderr_path, 'w') as stderr:
    process = subprocess.Popen([sys.executable, *argv], cwd=_REPO, env=env, stdout=stdout, stderr=stderr,
                               stdin=subprocess.DEVNULL, start_new_session=True,
                               preexec_fn=processes.default_signals)
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


def _run_cli(tmp_path, *args, extra_env=None):
  return _run_python(['-m', 'tff_gma.audit', *args], tmp_path, extra_env)


# TensorFlow's C++ start-up log lines (`2026-01-01 12:00:00.000000: E tensorflow/...] ...`), printed on import.
_TF_LOG_LINE = re.compile(r'^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+\] ')


def _messages(stderr):
  """stderr without TensorFlow's own start-up log lines."""
  return [line for line in stderr.splitlines() if line.strip() and not _TF_LOG_LINE.match(line)]


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


# A target module that cannot be imported is an error (2), not a verdict (1): the whole program, in a subprocess.


@pytest.mark.parametrize('source, problem', [
    ('computation = (\n', "SyntaxError: '(' was never closed ({path}, line 1)"),
    ('import no_such_dependency_xyz\n', "ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
], ids=['syntax_error', 'import_error'])
def test_unimportable_target_module_exits_two_with_one_message(tmp_path, source, problem):
  modules = tmp_path / 'modules'
  modules.mkdir()
  path = modules / 'broken_target.py'
  path.write_text(source)
  process = _run_cli(tmp_path, 'broken_target:computation', extra_env={'PYTHONPATH': str(modules)})
  assert process.returncode == cli.EXIT_ERROR, process.stderr
  assert process.stdout == ''
  assert _messages(process.stderr) == [
      "error: cannot import module 'broken_target' of target broken_target:computation: "
      + problem.format(path=path)]


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
    (['tests.tff_gma.audit.targets:no_such_target'], "has no attribute 'no_such_target'"),
    (['no_such_module_xyz:target'], 'ModuleNotFoundError'),
    (['tests.tff_gma.audit.targets:plain_sum_factory'], 'value_type is required'),
    (['tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'float32[x]'], 'bad dimension'),
    (['tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'notadtype[3]'], 'unknown dtype'),
])
def test_errors_exit_two(capsys, argv, message):
  assert cli.main(argv) == cli.EXIT_ERROR
  assert message in capsys.readouterr().err


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
  """A directory on sys.path for target modules; the modules imported from it are forgotten afterwards."""
  directory = tmp_path / 'modules'
  directory.mkdir()
  monkeypatch.syspath_prepend(str(directory))
  before = set(sys.modules)
  yield directory
  for name in set(sys.modules) - before:
    if getattr(sys.modules[name], '__file__', None) and sys.modules[name].__file__.startswith(str(directory)):
      del sys.modules[name]


def _failing_audit(*args, **kwargs):
  raise RuntimeError('walk failed')


# Every failure that is not a verdict: exit 2, one line on stderr naming the problem, no traceback, no report.
@pytest.mark.parametrize('source, argv, message', [
    ('raise RuntimeError("no data here")\n', ['audit_case_raises:x'],
     "cannot import module 'audit_case_raises' of target audit_case_raises:x: RuntimeError: no data here"),
    ('import sys\nsys.exit(0)\n', ['audit_case_exits:x'],
     "cannot import module 'audit_case_exits' of target audit_case_exits:x: it called sys.exit(0) while being "
     'imported'),
    ('x = 1\n', ['audit_case_attribute:y'],
     "target audit_case_attribute:y: module 'audit_case_attribute' has no attribute 'y'"),
    ('def build():\n  raise RuntimeError("cannot build")\n', ['audit_case_builder:build'],
     'target audit_case_builder:build: calling the builder raised RuntimeError: cannot build'),
    ('x = 3\n', ['audit_case_int:x'],
     'target audit_case_int:x is int, which the audit cannot read: expected a tff.Computation, a '
     'tff.templates.IterativeProcess (e.g. an AggregationProcess or LearningProcess), an aggregation factory, or '
     'a zero-argument callable returning one'),
    ('def build():\n  return [1]\n', ['audit_case_returns_list:build'],
     'target audit_case_returns_list:build() returned list, which the audit cannot read: expected'),
    ('import tensorflow_federated as tff\n@tff.federated_computation\ndef f(x):\n  return x\n',
     ['audit_case_polymorphic:f'],
     'target audit_case_polymorphic:f is a polymorphic computation (no parameter type yet)'),
    ('', ['tests.tff_gma.audit.targets:weighted_mean', '--output', '{dir}'], '--output {dir}: is a directory'),
    ('', ['tests.tff_gma.audit.targets:weighted_mean', '--output', '{dir}/missing/audit.md'],
     '--output {dir}/missing/audit.md: directory {dir}/missing does not exist'),
    ('', ['tests.tff_gma.audit.targets:weighted_mean', '--value_type', 'float32[3]'],
     'cannot audit tests.tff_gma.audit.targets:weighted_mean: ValueError: value_type/weight_type are only used '
     'with aggregation factories; got a'),
], ids=['import_raises', 'import_exits', 'missing_attribute', 'builder_raises', 'not_auditable',
        'builder_returns_not_auditable', 'polymorphic', 'output_is_a_directory', 'output_directory_missing',
        'value_type_for_a_computation'])
def test_failures_that_are_not_verdicts_exit_two(capsys, module_dir, source, argv, message):
  if source:
    (module_dir / f'{argv[0].partition(":")[0]}.py').write_text(textwrap.dedent(source))
  argv = [a.format(dir=module_dir) for a in argv]
  assert cli.main(argv) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  (line,) = captured.err.splitlines()
  assert line.startswith('error: ' + message.format(dir=module_dir)), line


def test_an_exception_inside_the_audit_exits_two(capsys, monkeypatch):
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(static, 'audit_computation', _failing_audit)
  assert cli.main(['tests.tff_gma.audit.targets:weighted_mean']) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  assert captured.err.splitlines() == [
      'error: cannot audit tests.tff_gma.audit.targets:weighted_mean: RuntimeError: walk failed']
  # --traceback adds the traceback for debugging.
  assert cli.main(['tests.tff_gma.audit.targets:weighted_mean', '--traceback']) == cli.EXIT_ERROR
  err = capsys.readouterr().err
  assert 'Traceback (most recent call last)' in err and 'walk failed' in err


def test_report_states_the_scope_of_a_pass(capsys):
  # The slotted mean passes (only federated_mean carries client data) although the server reads every client's
  # value off it; the report says what its PASS does and does not establish.
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  assert cli.main(['tests.tff_gma.audit.targets:slotted_mean']) == cli.EXIT_OK
  out = capsys.readouterr().out
  assert '**Verdict: PASS.**' in out
  assert f'**Scope.** {static.AUDIT_SCOPE}' in out
  assert 'its own coordinate of a `federated_mean`' in out
  assert cli.main(['tests.tff_gma.audit.targets:slotted_mean', '--format', 'json']) == cli.EXIT_OK
  assert json.loads(capsys.readouterr().out)['scope'] == static.AUDIT_SCOPE


@pytest.mark.parametrize('spec, expected', [
    ('float32', tff.TensorType(np.float32)),
    ('int32[3]', tff.TensorType(np.int32, [3])),
    ('float64[2, ?]', tff.TensorType(np.float64, [2, None])),
    ('tests.tff_gma.audit.targets:VALUE', tff.TensorType(np.float32, [3])),
    (None, None),
])
def test_parse_type(spec, expected):
  assert cli.parse_type(spec) == expected


# The audited code runs in a child process: code that ends the process is never read as a verdict.


@pytest.mark.parametrize('source, how', [
    ('import os\nos._exit(0)\n', 'exit status 0'),
    ('import os\nos._exit(1)\n', 'exit status 1'),
    ('import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n', 'killed by signal SIGKILL'),
    ('import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n', 'interrupted (Ctrl-C)'),
], ids=['exit0_at_import', 'exit1_at_import', 'sigkill', 'ctrl_c'])
def test_a_target_that_ends_the_process_is_no_verdict(tmp_path, source, how):
  modules = tmp_path / 'modules'
  modules.mkdir()
  (modules / 'ending_target.py').write_text(source)
  process = _run_cli(tmp_path, 'ending_target:computation', extra_env={'PYTHONPATH': str(modules)})
  assert process.returncode == cli.EXIT_ERROR, process.stderr
  assert process.stdout == ''
  assert _messages(process.stderr) == [
      f'error: the audit of ending_target:computation ended ({how}) before printing its report: the audited code '
      'ended the process; no verdict']


@pytest.mark.parametrize('argv, message', [
    (['tests.tff_gma.audit.targets:weighted_mean', '--format=xml'],
     "error: argument --format: invalid choice: 'xml'"),
    ([], 'error: the following arguments are required: target'),
    (['tests.tff_gma.audit.targets:weighted_mean', '--nope'], 'error: unrecognized arguments: --nope'),
], ids=['bad_choice', 'no_target', 'unknown_flag'])
def test_a_bad_argument_is_one_line_not_the_usage_and_no_audit(tmp_path, argv, message):
  process = _run_cli(tmp_path, *argv)
  assert process.returncode == cli.EXIT_ERROR and process.stdout == ''
  (line,) = _messages(process.stderr)  # Not argparse's usage block, nor "the audit ... ended" after it.
  assert line.startswith(message) and line.endswith('(python -m tff_gma.audit -h lists the options)'), line


def test_an_output_under_a_file_is_refused_before_the_audit(capsys, tmp_path):
  afile = tmp_path / 'afile'
  afile.write_text('')
  assert cli.main(['tests.tff_gma.audit.targets:weighted_mean', '--output', f'{afile}/audit.md']) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  assert captured.err == f'error: --output {afile}/audit.md: directory {afile} is a file, not a directory\n'


def test_help_is_printed_by_the_parent_and_exits_zero(tmp_path):
  process = _run_cli(tmp_path, '-h')
  assert process.returncode == 0 and process.stdout.startswith('usage: python -m tff_gma.audit')
  assert _messages(process.stderr) == []
