"""Tests for `python -m tff_gma.audit`: exit status, output formats, options, no leftover process, and a verdict
that the audited code can neither forge nor outlive (the target runs in a child; the parent gives the verdict)."""

import tests
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow_federated as tff

from tests.tff_gma import processes
from tff_gma.audit import __main__ as cli
from tff_gma.audit import isolation

_REPO = tests.ROOT
_in_process = cli.run_in_process


def _stat_fields(pid):
  """(ppid, pgrp, session) of a live process (None when it is gone or a zombie): the fields after the command's
  closing ')' of /proc/PID/stat are state, ppid, pgrp, session."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()
  except (FileNotFoundError, ProcessLookupError):
    return None
  return None if fields[0] in ('Z', 'X') else (int(fields[1]), int(fields[2]), int(fields[3]))


def _live_processes():
  """{pid: (ppid, pgrp, session)} of every live process."""
  found = {}
  for name in os.listdir('/proc'):
    if name.isdigit() and (fields := _stat_fields(int(name))) is not None:
      found[int(name)] = fields
  return found


def _session_members(session):
  return [pid for pid, (_, _, sid) in _live_processes().items() if sid == session]


def _children(pid):
  return [child for child, (ppid, _, _) in _live_processes().items() if ppid == pid]


def _popen_python(argv, stdout, stderr, extra_env=None):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', **(extra_env or {}))
  return subprocess.Popen([*processes.DEFAULT_SIGNALS, sys.executable, *argv], cwd=_REPO, env=env, stdout=stdout,
                          stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True)


def _run_python(argv, tmp_path, extra_env=None):
  """Runs `python ARGV` in its own session; fails (after killing them) if any process it started outlives it.

  Output goes to files, not pipes: a leftover TFF worker inherits its parent's stdout/stderr, and reading a pipe
  to its end would wait for the worker instead of reporting it.
  """
  stdout_path, stderr_path = tmp_path / 'stdout', tmp_path / 'stderr'
  with open(stdout_path, 'w') as stdout, open(stderr_path, 'w') as stderr:
    process = _popen_python(argv, stdout, stderr, extra_env)
    try:
      process.wait(timeout=300)
    finally:
      # It leads a new session: whatever it started is in that session (the audit's child in a process group of
      # its own, a TFF worker in its parent's), unless it made a session of its own.
      leftover = _session_members(process.pid)
      for pid in leftover:
        os.kill(pid, signal.SIGKILL)
      process.wait()
  assert not leftover, f'processes {leftover} started by {argv} outlived it (killed now)'
  return subprocess.CompletedProcess(argv, process.returncode, stdout_path.read_text(), stderr_path.read_text())


def _run_cli(tmp_path, *args, extra_env=None):
  return _run_python(['-m', 'tff_gma.audit', *args], tmp_path, extra_env)


# TensorFlow's C++ start-up log lines (`2026-01-01 12:00:00.000000: E tensorflow/...] ...`), printed on import, by
# the audit itself and by the target's process (whose lines the audit prefixes with `[target] `).
_TF_LOG_LINE = re.compile(r'^(\[target\] )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] \S+\] ')


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
  process = _run_cli(tmp_path, 'tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'float32[3]',
                     '--format', 'json', '--output', str(output))
  assert process.returncode == 1, process.stderr
  report = json.loads(process.stdout)
  assert json.loads(output.read_text()) == report
  assert report['ok'] is False
  assert [v['intrinsic'] for v in report['violations']] == ['federated_sum']
  assert report['subject'] == 'tests.tff_gma.audit.targets:plain_sum_factory (SumFactory.create(float32[3]))'


@pytest.mark.slow
def test_what_cannot_be_decided_exits_three_never_zero(tmp_path):
  # A functional parameter from CLIENTS to SERVER called on client data: the whole program, in a subprocess.
  process = _run_cli(tmp_path, 'tests.tff_gma.audit.targets:calls_a_functional_parameter')
  assert process.returncode == 3, process.stderr  # Before: 0, a PASS.
  assert cli.EXIT_UNDECIDED == 3
  assert '**Verdict: UNDECIDED (cannot be decided: 1 place the audit cannot see through).**' in process.stdout
  assert 'No client data reaches the server.' not in process.stdout
  assert '- in `computation` at `computation > calls_a_functional_parameter[0]`: calls the functional parameter' \
      in process.stdout


def test_the_exit_statuses_are_distinct_and_documented():
  assert len({cli.EXIT_OK, cli.EXIT_VIOLATIONS, cli.EXIT_ERROR, cli.EXIT_UNDECIDED}) == 4
  assert cli.EXIT_UNDECIDED not in (0, 1, 2)
  epilog = cli._parser().epilog  # pylint: disable=protected-access
  assert '3 UNDECIDED (cannot be decided' in epilog and 'never a PASS' in epilog
  assert 'Every public computation of a process is audited' in epilog


def test_undecided_in_json_and_with_a_violation(capsys):
  assert _in_process(['tests.tff_gma.audit.targets:calls_a_functional_parameter', '--format', 'json']) == (
      cli.EXIT_UNDECIDED)
  report = json.loads(capsys.readouterr().out)
  assert (report['verdict'], report['ok'], len(report['undecided'])) == ('UNDECIDED', False, 1)
  # A violation besides: FAIL (exit 1), with the undecided place still listed.
  assert _in_process(['tests.tff_gma.audit.targets:plain_sum_and_a_functional_parameter', '--format', 'json']) == (
      cli.EXIT_VIOLATIONS)
  report = json.loads(capsys.readouterr().out)
  assert (report['verdict'], len(report['violations']), len(report['undecided'])) == ('FAIL', 1, 1)


def test_every_public_computation_of_a_process_is_sent_and_audited(capsys):
  # `next` is clean; the leak is in `next_with_client_state`, which the child now sends too.
  assert _in_process(['tests.tff_gma.audit.targets:leaks_only_in_next_with_client_state']) == cli.EXIT_VIOLATIONS
  out = capsys.readouterr().out
  assert '### `next_with_client_state`: 1 pass' in out
  assert '- `federated_sum` in `next_with_client_state` at `next_with_client_state > ' in out


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


# In-process `run_in_process` (no child, no subprocess start-up; the same decoding, analysis and output as `main`):
# options and errors. `tests/` is on sys.path under pytest.


def test_policy_options(capsys):
  assert _in_process(['tests.tff_gma.audit.targets:plain_sum']) == cli.EXIT_VIOLATIONS
  assert _in_process(['tests.tff_gma.audit.targets:plain_sum', '--policy', 'allow-plain-sum']) == cli.EXIT_OK
  assert _in_process(['tests.tff_gma.audit.targets:client_max', '--policy', 'allow-plain-sum']) == cli.EXIT_VIOLATIONS
  assert _in_process(['tests.tff_gma.audit.targets:client_max', '--allow', 'federated_max']) == cli.EXIT_OK
  assert 'FAIL' in capsys.readouterr().out


def test_builder_callable_and_weight_type(capsys):
  code = _in_process(['tests.tff_gma.audit.targets:secure_mean_factory', '--value_type', 'float32[3]',
                      '--weight_type', 'float32'])
  assert code == cli.EXIT_OK
  out = capsys.readouterr().out
  assert 'MeanFactory.create(float32[3], float32)' in out
  assert 'bitwidth=32' in out


def test_rfa_report_shows_one_pass_per_weiszfeld_pass(capsys):
  # audit_targets.secure_rfa: the project's secure RFA with R = 2 passes, so 2 client-to-server rounds.
  assert _in_process(['tests.tff_gma.audit.targets:secure_rfa', '--value_type', 'float32[3]']) == cli.EXIT_OK
  out = capsys.readouterr().out
  assert 'Client-to-server aggregation passes per call of `next`: **2**.' in out
  assert '**Verdict: PASS.**' in out


@pytest.mark.parametrize('target, names', [
    ('staged_secure_rfa', ['initialize', 'stage_1', 'stage_2']),
    ('staged_rfa_learning_process', ['initialize', 'client_stage', 'aggregation_stage_1', 'aggregation_stage_2',
                                     'server_stage', 'get_model_weights', 'set_model_weights']),
])
def test_a_process_in_stages_is_audited_stage_by_stage(capsys, target, names):
  assert _in_process([f'tests.tff_gma.audit.targets:{target}', '--format', 'json']) == cli.EXIT_OK
  report = json.loads(capsys.readouterr().out)
  assert report['verdict'] == 'PASS'
  assert [c['name'] for c in report['computations']] == names
  # Each stage aggregates once: the secure means of one Weiszfeld pass, or the clients' metrics; the server's
  # update aggregates nothing.
  passes = {c['name']: c['aggregation_passes'] for c in report['computations']}
  assert all(passes[n] == (n != 'server_stage') for n in names if 'stage' in n), passes
  assert report['aggregation_passes'] == 1


@pytest.mark.parametrize('argv, message', [
    (['no_colon_here'], 'MODULE:ATTR'),
    (['tests.tff_gma.audit.targets:no_such_target'], "has no attribute 'no_such_target'"),
    (['no_such_module_xyz:target'], 'ModuleNotFoundError'),
    (['tests.tff_gma.audit.targets:plain_sum_factory'], 'value_type is required'),
    (['tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'float32[x]'], 'bad dimension'),
    (['tests.tff_gma.audit.targets:plain_sum_factory', '--value_type', 'notadtype[3]'], 'unknown dtype'),
])
def test_errors_exit_two(capsys, argv, message):
  assert _in_process(argv) == cli.EXIT_ERROR
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
    ('class Stop(BaseException):\n  pass\nclass Holder:\n  @property\n  def target(self):\n    raise Stop("no luck")\n'
     'holder = Holder()\n', ['audit_case_base_exception:holder.target'],
     "target audit_case_base_exception:holder.target: reading 'holder.target' raised Stop: no luck"),
    ('x = 3\n', ['audit_case_int:x'],
     'target audit_case_int:x is int, which the audit cannot read: expected a tff.Computation, a '
     'tff.templates.IterativeProcess (e.g. an AggregationProcess or LearningProcess), an aggregation factory, a '
     'process in stages (tff_gma.aggregators.StagedAggregationProcess, tff_gma.learning.StagedLearningProcess), or '
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
], ids=['import_raises', 'import_exits', 'missing_attribute', 'builder_raises', 'property_base_exception',
        'not_auditable', 'builder_returns_not_auditable', 'polymorphic', 'output_is_a_directory',
        'output_directory_missing', 'value_type_for_a_computation'])
def test_failures_that_are_not_verdicts_exit_two(capsys, module_dir, source, argv, message):
  if source:
    (module_dir / f'{argv[0].partition(":")[0]}.py').write_text(textwrap.dedent(source))
  argv = [a.format(dir=module_dir) for a in argv]
  assert _in_process(argv) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  (line,) = captured.err.splitlines()
  assert line.startswith('error: ' + message.format(dir=module_dir)), line


def test_an_exception_inside_the_audit_exits_two(capsys, monkeypatch):
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(static, '_audit_building_block', _failing_audit)  # The parent's analysis.
  assert _in_process(['tests.tff_gma.audit.targets:weighted_mean']) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  assert captured.err.splitlines() == [
      'error: cannot audit tests.tff_gma.audit.targets:weighted_mean: RuntimeError: walk failed']
  # --traceback adds the traceback for debugging.
  assert _in_process(['tests.tff_gma.audit.targets:weighted_mean', '--traceback']) == cli.EXIT_ERROR
  err = capsys.readouterr().err
  assert 'Traceback (most recent call last)' in err and 'walk failed' in err


def test_report_states_the_scope_of_a_pass(capsys):
  # The slotted mean passes (only federated_mean carries client data) although the server reads every client's
  # value off it; the report says what its PASS does and does not establish.
  from tff_gma import audit  # pylint: disable=g-import-not-at-top
  assert _in_process(['tests.tff_gma.audit.targets:slotted_mean']) == cli.EXIT_OK
  out = capsys.readouterr().out
  assert '**Verdict: PASS.**' in out
  assert f'**Scope.** {audit.AUDIT_SCOPE}' in out
  assert 'its own coordinate of a `federated_mean`' in out
  assert _in_process(['tests.tff_gma.audit.targets:slotted_mean', '--format', 'json']) == cli.EXIT_OK
  assert json.loads(capsys.readouterr().out)['scope'] == audit.AUDIT_SCOPE


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
    ('import ctypes\nctypes.string_at(0)\n', 'killed by signal SIGSEGV'),
], ids=['exit0_at_import', 'exit1_at_import', 'sigkill', 'ctrl_c', 'crash'])
def test_a_target_that_ends_the_process_is_no_verdict(tmp_path, source, how):
  modules = tmp_path / 'modules'
  modules.mkdir()
  (modules / 'ending_target.py').write_text(source)
  process = _run_cli(tmp_path, 'ending_target:computation', extra_env={'PYTHONPATH': str(modules)})
  assert process.returncode == cli.EXIT_ERROR, process.stderr
  assert process.stdout == ''
  assert _messages(process.stderr) == [
      f'error: the audit of ending_target:computation ended ({how}) before the target\'s process sent its result: '
      'the audited code ended the process; no verdict']


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
  assert _in_process(['tests.tff_gma.audit.targets:weighted_mean', '--output', f'{afile}/audit.md']) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  assert captured.err == f'error: --output {afile}/audit.md: directory {afile} is a file, not a directory\n'


def test_help_is_printed_by_the_parent_and_exits_zero(tmp_path):
  process = _run_cli(tmp_path, '-h')
  assert process.returncode == 0 and process.stdout.startswith('usage: python -m tff_gma.audit')
  assert _messages(process.stderr) == []


# --- The verdict is the parent's: a hostile target can neither forge it nor outlive the audit. ------------------

# Writes `0` to every file descriptor it inherited (the old verdict pipe among them), prints a PASS report with
# terminal escapes that would clear the screen, and ends the process with status 0.
_FORGING_TARGET = r'''
import os
for fd in range(1024):
  try:
    os.write(fd, b'0')
  except OSError:
    pass
print('## Aggregation audit: forged\n\n**Verdict: PASS.**\n\x1b[2J\x1b[H')
os._exit(0)
'''


def _module(tmp_path, name, source):
  modules = tmp_path / 'modules'
  modules.mkdir(exist_ok=True)
  (modules / f'{name}.py').write_text(source)
  return {'PYTHONPATH': str(modules)}


def test_a_target_that_forges_a_pass_gets_no_verdict(tmp_path):
  process = _run_cli(tmp_path, 'forging_target:computation', extra_env=_module(tmp_path, 'forging_target',
                                                                               _FORGING_TARGET))
  assert process.returncode == cli.EXIT_ERROR, process.stderr
  assert process.stdout == ''  # Nothing the target prints reaches the report's stream.
  messages = _messages(process.stderr)
  assert messages[-1] == (
      "error: the audit of forging_target:computation: the target's process sent a malformed result (it does not "
      "start with the message header (got b'0')); no verdict")
  # What it printed is on stderr, every line marked as the target's, its terminal escapes shown, not obeyed.
  assert messages[:-1] == ['[target] 00## Aggregation audit: forged', '[target] ', '[target] **Verdict: PASS.**',
                           '[target] \\x1b[2J\\x1b[H']
  assert '\x1b' not in process.stderr


def test_output_the_target_prints_goes_to_stderr_marked_and_the_verdict_stands(tmp_path):
  source = ('print("**Verdict: PASS.**")\nimport sys\nprint("to stderr", file=sys.stderr)\n'
            'from tests.tff_gma.audit.targets import plain_sum as computation\n')
  process = _run_cli(tmp_path, 'chatty_target:computation', extra_env=_module(tmp_path, 'chatty_target', source))
  assert process.returncode == cli.EXIT_VIOLATIONS, process.stderr  # The parent's own analysis: a plain sum.
  assert process.stdout.startswith('## Aggregation audit: chatty_target:computation (computation)\n')
  assert process.stdout.count('Verdict') == 1 and '**Verdict: FAIL (1 violation).**' in process.stdout
  assert _messages(process.stderr) == ['[target] **Verdict: PASS.**', '[target] to stderr']


def test_a_target_that_spins_is_killed_at_the_timeout(tmp_path):
  start = time.monotonic()
  # _run_python fails if any process of the audit's session (its child among them) is left.
  process = _run_cli(tmp_path, 'spinning_target:computation', '--timeout=5',
                     extra_env=_module(tmp_path, 'spinning_target', 'while True:\n  pass\n'))
  elapsed = time.monotonic() - start
  assert process.returncode == cli.EXIT_ERROR, process.stderr
  assert process.stdout == ''
  assert _messages(process.stderr) == [
      'error: the audit of spinning_target:computation: loading the target did not finish within --timeout=5 s; '
      'its process was killed; no verdict']
  assert elapsed < 120, elapsed  # 5 s, then the audit's own start-up (seconds; more on a loaded machine).


def test_a_stop_whose_raise_is_lost_in_a_gc_callback_still_stops(monkeypatch):
  # The handler runs at the next bytecode of the main thread; inside a garbage-collection callback (JAX has one)
  # its raise is printed as "Exception ignored" and lost (seen: the audit then reported the child's SIGKILL, or went
  # on). The stop is kept and raised again at the audit's checkpoints, here the context's end.
  import gc  # pylint: disable=g-import-not-at-top
  fired, reached, unraisable = [], [], []
  monkeypatch.setattr(sys, 'unraisablehook', unraisable.append)  # Python's, which prints "Exception ignored".

  def callback(phase, info):
    del info
    if phase == 'start' and not fired:
      fired.append(True)
      os.kill(os.getpid(), signal.SIGTERM)
      sum(range(1000))  # Bytecode in the callback: the handler runs here, and its Stopped is lost.

  gc.callbacks.append(callback)
  try:
    with pytest.raises(isolation.Stopped, match='SIGTERM'):
      with isolation.stop_on_signals():
        gc.collect()
        reached.append(True)
  finally:
    gc.callbacks.remove(callback)
  assert fired and reached  # The raise was lost (the body went on), and the stop was still raised at the end.
  assert not unraisable  # The audit's stop is one line: no stray "Exception ignored" traceback for the lost raise.
  isolation.raise_if_stopped()  # Cleared once the context is left: no stale stop for a later audit.


def test_a_stop_that_lands_in_code_raising_another_error_still_ends_the_audit_as_stopped():
  """The handler's raise lands wherever the main thread is: in an import, TensorFlow's code caught it and raised
  `AttributeError: 'list' object has no attribute '_type_spec'`, which read as an internal error."""

  def import_cut_short():
    try:
      os.kill(os.getpid(), signal.SIGTERM)
      sum(range(1000))  # Bytecode: the handler runs here.
    except isolation.Stopped as e:
      raise AttributeError("'list' object has no attribute '_type_spec'") from e

  with pytest.raises(isolation.Stopped, match='SIGTERM') as stopped:
    with isolation.stop_on_signals():
      import_cut_short()
  assert isinstance(stopped.value.__cause__, AttributeError)
  isolation.raise_if_stopped()  # Cleared once the context is left.


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=['sigterm', 'sigint',
                                                                                         'sigkill'])
def test_the_target_process_dies_with_the_audit(tmp_path, signum):
  spinning = tmp_path / 'spinning'  # Made by the target once it runs: the child is then in its endless loop.
  env = _module(tmp_path, 'spinning_target', f'open({str(spinning)!r}, "w").close()\nwhile True:\n  pass\n')
  with open(tmp_path / 'stdout', 'w') as stdout, open(tmp_path / 'stderr', 'w') as stderr:
    process = _popen_python(['-m', 'tff_gma.audit', 'spinning_target:computation'], stdout, stderr, env)
    try:
      deadline = time.monotonic() + 120
      while not spinning.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
      children = _children(process.pid)
      assert spinning.exists() and len(children) == 1, (children, process.poll())
      assert processes.alive(children[0])
      os.kill(process.pid, signum)
      process.wait(timeout=120)
      # The child, by its pid (after SIGKILL the kernel kills it, PR_SET_PDEATHSIG: a zombie of init, or gone).
      gone = all(processes.wait_gone(pid, timeout=10) for pid in children)
    finally:
      leftover = _session_members(process.pid)
      for pid in leftover:
        os.kill(pid, signal.SIGKILL)
      process.kill()
      process.wait()
  assert gone, children
  assert not leftover, leftover
  if signum == signal.SIGKILL:
    assert process.returncode == -signal.SIGKILL
  else:
    assert process.returncode == cli.EXIT_ERROR
    assert _messages((tmp_path / 'stderr').read_text()) == [
        f'error: the audit of spinning_target:computation was stopped by {signal.Signals(signum).name}; the '
        'target\'s process is gone; no verdict']
  assert (tmp_path / 'stdout').read_text() == ''


@pytest.mark.parametrize('target, problem', [
    ('names_with_a_fake_verdict_line', "the computation's names hold line breaks or control characters"),
    ('names_with_a_fake_verdict', "a name in the computation imitates the report's verdict line"),
])
def test_names_that_imitate_the_report_are_no_verdict(capsys, target, problem):
  assert _in_process([f'tests.tff_gma.audit.targets:{target}']) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  (line,) = captured.err.splitlines()
  assert line.startswith(f'error: the audit of tests.tff_gma.audit.targets:{target}: {problem}'), line
  assert line.endswith('; no verdict')


# The child's message, decoded by the parent: anything but a well-formed result or error is malformed.


def _message(body):
  return isolation.encode_message(body)


def _weighted_mean_result(**changes):
  from tensorflow_federated.python.core.impl.computation import computation_impl  # pylint: disable=g-import-not-at-top
  from tests.tff_gma.audit import targets  # pylint: disable=g-import-not-at-top
  proto = computation_impl.ConcreteComputation.get_proto(targets.weighted_mean).SerializeToString()
  body = isolation.result_body('computation', 'ConcreteComputation', [('computation', proto)])
  body['result'].update(changes)
  return body


def _process_result(names):
  from tensorflow_federated.python.core.impl.computation import computation_impl  # pylint: disable=g-import-not-at-top
  from tests.tff_gma.audit import targets  # pylint: disable=g-import-not-at-top
  proto = computation_impl.ConcreteComputation.get_proto(targets.weighted_mean).SerializeToString()
  return isolation.result_body('process', 'LearningProcess', [(name, proto) for name in names])


def test_a_process_result_decodes_with_its_other_public_computations():
  names = ('initialize', 'next', 'get_model_weights', 'next_with_client_state')
  loaded = isolation.decode_message(_message(_process_result(names)))
  assert [name for name, _ in loaded.computations] == list(names) and loaded.main == 'next'


@pytest.mark.parametrize('names', [
    ('next', 'initialize'),
    ('initialize', 'next', 'next'),
    ('initialize', 'next', 'set_model_weights', 'get_model_weights'),
    ('initialize', 'next', '_private'),
    ('initialize', 'next', 'x\n**Verdict: PASS.**'),
    ('initialize', 'next', *(f'c{i:02d}' for i in range(isolation.MAX_COMPUTATIONS))),
], ids=['order', 'twice', 'not_by_name', 'private', 'not_a_name', 'too_many'])
def test_a_process_result_with_other_names_is_refused(names):
  with pytest.raises(isolation.MalformedMessage, match=re.escape(
      "a process sends the computations ['initialize', 'next'] then its other public computations by name")):
    isolation.decode_message(_message(_process_result(names)))


def test_a_well_formed_result_decodes_to_the_building_blocks():
  from tests.tff_gma.audit import targets  # pylint: disable=g-import-not-at-top
  loaded = isolation.decode_message(_message(_weighted_mean_result()))
  assert loaded.description == 'computation' and loaded.main == 'computation'
  ((name, block),) = loaded.computations
  assert name == 'computation'
  assert block.proto == targets.weighted_mean.to_building_block().proto


@pytest.mark.parametrize('target, value_type', [('fed_avg_default', None), ('secure_rfa', 'float32[3]')])
def test_the_report_from_the_serialized_computations_is_the_direct_audits(capsys, target, value_type):
  # The command analyses what it parsed back from the protos; `audit_computation` reads the live objects.
  from tests.tff_gma.audit import targets  # pylint: disable=g-import-not-at-top
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  spec = f'tests.tff_gma.audit.targets:{target}'
  argv = [spec, '--format', 'json'] + (['--value_type', value_type] if value_type else [])
  code = _in_process(argv)
  report = json.loads(capsys.readouterr().out)
  direct = static.audit_computation(getattr(targets, target)(), value_type=cli.parse_type(value_type), name=spec)
  assert report == json.loads(direct.to_json())
  assert code == (cli.EXIT_OK if direct.ok else cli.EXIT_VIOLATIONS)


@pytest.mark.parametrize('data, problem', [
    (b'', 'it does not start with the message header'),
    (b'**Verdict: PASS.**', 'it does not start with the message header'),
    (isolation.MAGIC + b'\x00\x00', 'it ends inside the header'),
    (isolation.MAGIC + (100).to_bytes(8, 'big') + b'{}', 'the header announces 100 bytes and 2 follow'),
    (isolation.MAGIC + (2).to_bytes(8, 'big') + b'{}{}', 'the header announces 2 bytes and 4 follow'),
    (isolation.MAGIC + (3).to_bytes(8, 'big') + b'{x}', 'the body is not JSON'),
    (isolation.encode_message({'verdict': 'PASS'}), 'the body has no'),
    (isolation.encode_message({'result': {}, 'error': 'x', 'traceback': None}),
     'the body is neither one result nor one error'),
], ids=['empty', 'text', 'short_header', 'truncated', 'trailing', 'not_json', 'unknown_body', 'both'])
def test_a_malformed_message_is_refused(data, problem):
  with pytest.raises(isolation.MalformedMessage, match='^' + re.escape(problem)):
    isolation.decode_message(data)


@pytest.mark.parametrize('changes, problem', [
    ({'kind': 'verdict'}, "unknown kind 'verdict'"),
    ({'class': 'X\n**Verdict: PASS.**'}, "the class name 'X\\\\n**Verdict: PASS.**' is not an identifier"),
    ({'computations': []}, "a computation sends the computations ['computation']"),
    ({'computations': [['next', 'AA==']]}, "a computation sends the computations ['computation']"),
    ({'computations': [['computation', 'AA=='], ['next', 'AA==']]},
     "a computation sends the computations ['computation'], each once"),
    ({'computations': [['computation', '!!']]}, "the computation 'computation' is not base64"),
    ({'computations': [['computation', 'AAAA']]}, "the computation 'computation' does not parse"),
    ({'value_type': 'AA=='}, 'value and weight types come with a factory'),
    ({'ok': True}, 'the result has the fields'),
], ids=['kind', 'class', 'no_computation', 'wrong_name', 'a_second', 'not_base64', 'not_a_proto', 'types',
        'extra_field'])
def test_a_malformed_result_is_refused(changes, problem):
  with pytest.raises(isolation.MalformedMessage, match='^' + re.escape(problem)):
    isolation.decode_message(_message(_weighted_mean_result(**changes)))


def test_an_error_message_is_one_escaped_line_and_never_a_verdict():
  with pytest.raises(isolation.TargetError) as raised:
    isolation.decode_message(_message(isolation.error_body('first\nsecond \x1b[2J', 'Traceback ...')))
  assert str(raised.value) == 'first second \\x1b[2J'
  assert raised.value.traceback_text == 'Traceback ...'


# --output: never through a symbolic link; written atomically.


@pytest.mark.parametrize('dangling', [False, True], ids=['to_a_file', 'dangling'])
def test_an_output_that_is_a_symbolic_link_is_refused_and_its_target_untouched(capsys, tmp_path, dangling):
  victim = tmp_path / 'victim'
  if not dangling:
    victim.write_text('precious\n')
  link = tmp_path / 'audit.md'
  link.symlink_to(victim)
  assert _in_process(['tests.tff_gma.audit.targets:weighted_mean', '--output', str(link)]) == cli.EXIT_ERROR
  captured = capsys.readouterr()
  assert captured.out == ''
  assert captured.err == (f'error: --output {link}: is a symbolic link (to {victim}); the audit does not write '
                          'through one\n')
  assert link.is_symlink() and os.readlink(link) == str(victim)
  if dangling:
    assert not victim.exists()
  else:
    assert victim.read_text() == 'precious\n'
  assert sorted(os.listdir(tmp_path)) == sorted(['audit.md'] + ([] if dangling else ['victim']))


def test_a_link_planted_during_the_audit_is_replaced_not_written_through(tmp_path):
  victim = tmp_path / 'victim'
  victim.write_text('precious\n')
  path = tmp_path / 'audit.md'
  path.symlink_to(victim)
  with pytest.raises(cli.CommandError, match='is a symbolic link'):
    cli._write_output(str(path), 'report\n')  # pylint: disable=protected-access
  path.unlink()
  os.link(victim, path)  # A second name of the victim: a write in place would change it.
  cli._write_output(str(path), 'report\n')  # pylint: disable=protected-access
  assert path.read_text() == 'report\n' and not path.is_symlink()
  assert victim.read_text() == 'precious\n'
  assert sorted(os.listdir(tmp_path)) == ['audit.md', 'victim']  # No temporary file left.


@pytest.mark.parametrize('value', ['0', '-1', 'nan', 'inf', 'soon'])
def test_a_bad_timeout_is_one_line(capsys, value):
  with pytest.raises(SystemExit) as raised:
    cli.main(['tests.tff_gma.audit.targets:weighted_mean', f'--timeout={value}'])
  assert raised.value.code == cli.EXIT_ERROR
  assert capsys.readouterr().err == (f"error: argument --timeout: expected a positive number of seconds, got "
                                     f"'{value}' (python -m tff_gma.audit -h lists the options)\n")
