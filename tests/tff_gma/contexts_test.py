"""Which TFF execution context runs what (docs/runtime.md#contexts), and that importing the library leaves TFF alone.

* Importing any module of the library changes nothing in TFF or the process: TFF's default context, `sys.meta_path`,
  exit hooks, signal handlers and TF's log filters are as before. A script under TFF's default or test context,
  started as a background job (SIGINT ignored), ends exactly as the same script without the library does.
* Forgetting `set_simulation_context()`: where the library's own code runs a computation (the runner,
  `runtime.check_context_runs`), TFF's native context is refused in one line naming the fix, before any worker
  starts.
* TFF's own `set_sync_test_cpp_execution_context()` runs the factories (on TFF's unconfined worker).
* `set_async_simulation_context()`: the confined context TFF programs need; `tff.learning.programs.train_model`
  trains GMA in it.
* The multi-worker context refuses a multi-stage computation where it is invoked, in one line.
* A script that installs the library's context exits clean: no traceback from TFF's `__del__`, no worker left.

Tests that run a child Python are in the slow tier. Children run in their own process group, so that whatever they
start (TFF's own worker included) is killed if a test fails before it checks.
"""

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import tensorflow_federated as tff

import tests
from tests.tff_gma import background
from tests.tff_gma import processes
from tff_gma import aggregators
from tff_gma import models
from tff_gma import runtime
from tff_gma.data import digits
from tff_gma.runtime import contexts as runtime_contexts

_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')

# Three clients' values and weights for one call of an aggregation process; every factory below uses secure sums.
_VALUES = [[1.0, -2.0, 3.0], [2.0, -1.0, -3.0], [0.5, -0.5, 1.0]]
_WEIGHTS = [1.0, 2.0, 1.0]
_FACTORIES = {
    'gma': 'aggregators.GradientMaskedFactory(tau=0.4)',
    'rfa': 'aggregators.GeometricMedianFactory(num_passes=3, secure=True, value_bound=10.0)',
}

_HELPERS = textwrap.dedent('''
    import json, os, sys
    import numpy as np

    def tff_worker_children():
      """pids of this process's children that are TFF's own worker binary (TFF's contexts start it directly)."""
      found = []
      for pid in os.listdir('/proc'):
        try:
          with open(f'/proc/{pid}/stat') as f:
            ppid = f.read().rsplit(')', 1)[1].split()[1]
          with open(f'/proc/{pid}/cmdline', 'rb') as f:
            argv0 = f.read().split(b'\\0')[0]
        except (OSError, IndexError):
          continue
        if ppid == str(os.getpid()) and argv0.endswith(b'worker_binary'):
          found.append(int(pid))
      return found

    def run_factories(factories, values, weights):
      import tensorflow_federated as tff
      from tff_gma import aggregators
      results = {}
      for name, expression in factories.items():
        process = eval(expression).create(tff.TensorType(np.float32, [3]), tff.TensorType(np.float32))
        output = process.next(process.initialize(), [np.array(v, np.float32) for v in values],
                              [np.float32(w) for w in weights])
        results[name] = np.asarray(output.result).tolist()
      return results
''')


def _run_child(code: str, timeout: float = 300, pipes: bool = True):
  """Runs `code` (after `_HELPERS`) in a fresh Python; returns (returncode, stdout, stderr). With `pipes`, its
  output goes to pipes, and this times out (and fails) if anything the child started keeps them open after it
  ends; without, to files (for TFF's own contexts, whose worker outlives the child holding its output), and this
  returns when the child ends."""
  if pipes:
    out_file = err_file = subprocess.PIPE
  else:
    out_file, err_file = tempfile.TemporaryFile('w+'), tempfile.TemporaryFile('w+')
  child = subprocess.Popen([*processes.DEFAULT_SIGNALS, sys.executable, '-c', _HELPERS + textwrap.dedent(code)],
                           cwd=tests.ROOT, env=_ENV, stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file,
                           text=True, start_new_session=True)
  try:
    if pipes:
      out, err = child.communicate(timeout=timeout)
    else:
      child.wait(timeout=timeout)
      out, err = _read_and_close(out_file), _read_and_close(err_file)
  finally:
    try:
      os.killpg(child.pid, signal.SIGKILL)  # Whatever of the child's group is left (nothing, when all is well).
    except ProcessLookupError:
      pass
    child.wait()
  return child.returncode, out, err


def _read_and_close(file) -> str:
  with file:
    file.seek(0)
    return file.read()


def _assert_clean_exit(returncode, out, err):
  assert returncode == 0, err[-3000:]
  assert 'Traceback' not in err and 'Exception ignored' not in err, err[-3000:]


def _marked(out: str, marker: str) -> str:
  return next(line for line in out.splitlines() if line.startswith(marker + ' '))[len(marker) + 1:]


# ----------------------------------------------------------------------------------------------------------------
# Forgetting the context.


def _direct_children() -> set[int]:
  me = str(os.getpid())
  children = set()
  for pid in os.listdir('/proc'):
    try:
      with open(f'/proc/{pid}/stat') as f:
        if f.read().rsplit(')', 1)[1].split()[1] == me:
          children.add(int(pid))
    except (OSError, IndexError):
      continue
  return children


def _secure_total():
  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def secure_total(x):
    return tff.federated_secure_sum_bitwidth(x, 8)
  return secure_total


def test_the_library_refuses_tffs_native_context_in_one_line_before_any_worker_starts():
  process = aggregators.GradientMaskedFactory(tau=0.4).create(tff.TensorType(np.float32, [3]),
                                                               tff.TensorType(np.float32))
  native = tff.backends.native.create_sync_local_cpp_execution_context()
  before = _direct_children()
  with tff.framework.get_context_stack().install(native):
    with pytest.raises(RuntimeError) as raised:
      runtime.check_context_runs(process)  # What the runner calls before training.
    runtime.check_context_runs(process.initialize)  # No secure sum: TFF's context runs it.
  message = str(raised.value)
  assert '\n' not in message and len(message) < 400, message
  assert message.startswith('this computation calls federated_secure_sum (secure '
                            'aggregation), which TFF\'s default context cannot run: call '
                            'tff_gma.runtime.set_simulation_context()'), message
  assert 'tff.backends.test.set_sync_test_cpp_execution_context()' in message
  assert 'docs/runtime.md#troubleshooting' in message
  assert _direct_children() == before  # Refused before TFF's worker was started.
  # The program form of TFF's native context is refused too; the library's and TFF's test context are not.
  program_native = tff.program.NativeFederatedContext(tff.backends.native.create_async_local_cpp_execution_context())
  with tff.framework.get_context_stack().install(program_native):
    with pytest.raises(RuntimeError, match='call tff_gma.runtime.set_simulation_context'):
      runtime.check_context_runs(_secure_total())
  runtime.check_context_runs(process)  # The suite's context.
  with tff.framework.get_context_stack().install(tff.backends.test.create_sync_test_cpp_execution_context()):
    runtime.check_context_runs(process)


def test_the_runner_refuses_tffs_native_context_in_one_line_before_writing_anything(tmp_path):
  from training import config as config_lib  # pylint: disable=g-import-not-at-top
  from training.runner import experiment  # pylint: disable=g-import-not-at-top
  config = config_lib.ExperimentConfig(
      dataset='digits', partition='iid', num_clients=3, clients_per_round=2, rounds=1, model='logistic',
      batch_size=32, aggregator='gma', output_dir=str(tmp_path / 'run'))
  before = _direct_children()
  # A caller's TFF native context, installed over the default: the runner cannot replace it, so it refuses it.
  with tff.framework.get_context_stack().install(tff.backends.native.create_sync_local_cpp_execution_context()):
    with pytest.raises(RuntimeError) as raised:
      experiment.run(config, show_progress=False)
  message = str(raised.value)
  assert '\n' not in message and 'call tff_gma.runtime.set_simulation_context()' in message, message
  assert not os.path.exists(os.path.join(config.output_dir, experiment.CONFIG_FILE))  # Nothing trained or written.
  assert _direct_children() == before


def test_simulation_context_applies_to_tffs_native_context_only():
  stack = tff.framework.get_context_stack()
  assert runtime_contexts.simulation_context_applies()  # The suite's (the library's) context.
  with stack.install(tff.backends.native.create_sync_local_cpp_execution_context()):
    assert runtime_contexts.simulation_context_applies()  # TFF's import-time kind: the runner installs its own instead.
  with stack.install(tff.backends.test.create_sync_test_cpp_execution_context()):
    assert not runtime_contexts.simulation_context_applies()  # A context the caller chose, that runs the secure sums.


def test_reinstalling_the_default_context_collects_nothing_and_replacing_it_collects_the_old_one(monkeypatch):
  import gc  # pylint: disable=g-import-not-at-top
  collections = []
  monkeypatch.setattr(gc, 'collect', lambda *args: collections.append(args) or 0)
  runtime.set_simulation_context()  # The default already (the suite's): nothing replaced, nothing to collect.
  assert not collections
  try:
    runtime_contexts.install_default(tff.backends.test.create_sync_test_cpp_execution_context())
    assert len(collections) == 1
  finally:
    runtime.set_simulation_context()  # Back to the suite's, the test context collected.
  assert len(collections) == 2


_JOB_SCRIPT = textwrap.dedent(r"""
    import time
    import tensorflow_federated as tff
    if {with_library!r}:
      import tff_gma.aggregators, tff_gma.models, tff_gma.runtime  # Modules of the library (not called).
    if {context!r} == 'test':
      tff.backends.test.set_sync_test_cpp_execution_context()

    @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
    def total(x):
      return tff.federated_sum(x)

    print('SUM', total([1, 2, 3]), flush=True)
    with open('/proc/self/status') as f:
      print('SIGIGN', next(l for l in f if l.startswith('SigIgn:')).split()[1], flush=True)
    print('WORKERS', json.dumps(tff_worker_children()), flush=True)
    print('DONE', time.time(), flush=True)
""")


@pytest.mark.slow  # Child Pythons.
@pytest.mark.parametrize('context', ['default', 'test'])
def test_a_background_job_under_tffs_context_ends_as_it_does_without_the_library(context, tmp_path):
  # Started with `&` by a script or nohup, a process ignores SIGINT, and so does the worker TFF starts. The library
  # once stopped TFF's worker at exit with SIGINT and waited for it without a limit: such a job printed its result
  # and never ended. TFF 0.87 alone ends at once and leaves its worker running (it stops it only from a `__del__`
  # that does not run at exit): the library must change neither.
  outcomes = {}
  for with_library in (True, False):
    directory = tmp_path / str(with_library)
    directory.mkdir()
    job = background.run_background_job(
        _HELPERS + _JOB_SCRIPT.format(with_library=with_library, context=context), str(directory), tests.ROOT, _ENV)
    workers = []
    try:
      assert job.marked('SUM') == '6', job.stderr[-3000:]
      assert int(job.marked('SIGIGN'), 16) & (1 << (signal.SIGINT - 1)), 'the job did not ignore SIGINT'
      workers = json.loads(job.marked('WORKERS'))
      assert len(workers) == 1  # TFF's worker binary, a direct child.
      assert job.exit_delay_s is not None, (
          f'with_library={with_library}: the job printed its result and did not end within 20 s')
      assert job.exit_delay_s < 20.0
      left = not processes.wait_gone(workers[0], 2.0)
      outcomes[with_library] = (job.returncode, left, 'Traceback' in job.stderr)
    finally:
      job.cleanup(workers)  # TFF's orphan (in the job's process group), whatever the outcome.
  assert outcomes[True] == outcomes[False], outcomes


_REPLACE_SCRIPT = textwrap.dedent(r"""
    import time
    import tensorflow_federated as tff
    from tff_gma import runtime

    @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
    def total(x):
      return tff.federated_sum(x)

    print('TFF_SUM', total([1, 2, 3]), flush=True)  # In TFF's import-time context: TFF's own worker starts.
    before = tff_worker_children()
    print('BEFORE', json.dumps(before), flush=True)
    runtime.set_simulation_context()
    print('AFTER', json.dumps(tff_worker_children()), flush=True)
    print('REAPED', json.dumps([not os.path.exists(f'/proc/{pid}') for pid in before]), flush=True)
    print('SUM', total([1, 2, 3]), flush=True)
    print('DONE', time.time(), flush=True)
""")


@pytest.mark.slow  # A child Python and TFF's own worker.
def test_replacing_tffs_default_context_stops_the_worker_it_started_even_in_a_background_job(tmp_path):
  # TFF stops its worker only from the context's `__del__`, with SIGINT and a wait without limit: in a background
  # job the worker ignores SIGINT, and installing the library's context would wait forever. The library stops it
  # first, bounded (`stop_tff_worker_of_default_context`, through `tff_gma.tff_internals`), and TFF reaps it.
  job = background.run_background_job(_HELPERS + _REPLACE_SCRIPT, str(tmp_path), tests.ROOT, _ENV)
  workers = []
  try:
    assert job.marked('TFF_SUM') == '6', job.stderr[-3000:]
    workers = json.loads(job.marked('BEFORE'))
    assert len(workers) == 1  # TFF's worker binary, a direct child.
    assert workers[0] not in json.loads(job.marked('AFTER'))
    assert json.loads(job.marked('REAPED')) == [True]  # Stopped, and reaped when its context was collected.
    assert job.marked('SUM') == '6'  # In the library's context.
    assert job.exit_delay_s is not None and job.exit_delay_s < 20.0
    assert job.returncode == 0, job.stderr[-3000:]
    assert 'Traceback' not in job.stderr and 'Exception ignored' not in job.stderr, job.stderr[-3000:]
  finally:
    job.cleanup(workers)


_IMPORT_CHECK = textwrap.dedent(r"""
    import atexit, json, logging, pkgutil, signal, sys

    def snapshot():
      tff = sys.modules.get('tensorflow_federated')
      current = tff.framework.get_context_stack().current if tff else None
      return {
          'context': None if current is None else f'{type(current).__module__}.{type(current).__name__}@{id(current)}',
          'meta_path': [repr(f) for f in sys.meta_path],
          'atexit': atexit._ncallbacks(),
          'signals': {int(s): repr(signal.getsignal(s)) for s in signal.valid_signals()
                      if s not in (signal.SIGKILL, signal.SIGSTOP)},
          'tf_log_filters': [repr(f) for f in logging.getLogger('tensorflow').filters],
      }

    before = snapshot()
    import tff_gma
    after_package = snapshot()
    import tensorflow_federated as tff
    with_tff = snapshot()
    modules = []
    for info in pkgutil.walk_packages(tff_gma.__path__, 'tff_gma.'):
      if not info.name.endswith('.__main__'):
        __import__(info.name)
        modules.append(info.name)
    after_modules = snapshot()
    print('RESULT', json.dumps({'before': before, 'after_package': after_package, 'with_tff': with_tff,
                                'after_modules': after_modules, 'modules': modules}), flush=True)
""")


@pytest.mark.slow  # A child Python.
def test_importing_the_library_changes_nothing_in_tff_or_the_process():
  returncode, out, err = _run_child(_IMPORT_CHECK)
  assert returncode == 0, err[-3000:]
  result = json.loads(_marked(out, 'RESULT'))
  assert {'tff_gma.runtime', 'tff_gma.aggregators', 'tff_gma.worker', 'tff_gma.confinement'} <= set(result['modules'])
  # `import tff_gma` before TFF: no import hook, no exit hook, no signal handler.
  assert result['after_package'] == result['before']
  # TFF's default context is TFF's own, not wrapped.
  assert result['with_tff']['context'].startswith(
      'tensorflow_federated.python.core.impl.execution_contexts.sync_execution_context.SyncExecutionContext@')
  # Every module of the library imported after TFF: the same context object, and nothing else changed either.
  assert result['after_modules'] == result['with_tff']


# ----------------------------------------------------------------------------------------------------------------
# TFF's own test context.


@pytest.mark.slow  # A child Python.
def test_tffs_test_context_runs_the_factories_on_its_own_unconfined_worker():
  returncode, out, err = _run_child(f'''
      import tensorflow_federated as tff
      tff.backends.test.set_sync_test_cpp_execution_context()
      print('RESULTS', json.dumps(run_factories({_FACTORIES!r}, {_VALUES!r}, {_WEIGHTS!r})), flush=True)
      print('WORKERS', json.dumps(tff_worker_children()), flush=True)
  ''', pipes=False)
  assert returncode == 0, err[-3000:]  # What TFF's own context prints at exit is TFF's (see the background test).
  theirs = json.loads(_marked(out, 'RESULTS'))
  # The same factories in this library's simulation context (the suite's): the same results.
  namespace = {}
  exec(_HELPERS, namespace)  # pylint: disable=exec-used
  ours = namespace['run_factories'](_FACTORIES, _VALUES, _WEIGHTS)
  for name in _FACTORIES:
    np.testing.assert_allclose(theirs[name], ours[name], rtol=1e-6, atol=1e-6)
  assert not np.allclose(ours['gma'], np.average(_VALUES, axis=0, weights=_WEIGHTS))  # GMA masked something.
  # TFF's context started its worker binary itself: a direct child, listening on a TCP port of its own. TFF
  # leaves it running at exit; `_run_child` killed it with the child's process group.
  workers = json.loads(_marked(out, 'WORKERS'))
  assert len(workers) == 1
  assert processes.wait_gone(workers[0])


# ----------------------------------------------------------------------------------------------------------------
# The context for TFF programs.


@pytest.mark.slow  # A child Python.
def test_async_context_shares_the_confined_worker_and_it_stops_with_python():
  returncode, out, err = _run_child('''
      import asyncio
      import tensorflow_federated as tff
      from tff_gma import runtime

      @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
      def secure_total(x):
        return tff.federated_secure_sum_bitwidth(x, 8)

      worker = runtime.set_async_simulation_context()
      assert isinstance(tff.framework.get_context_stack().current, tff.program.FederatedContext)

      async def program():
        return await tff.program.materialize_value(secure_total([1, 2, 3]))

      assert asyncio.run(program()) == 6
      assert runtime.set_simulation_context() is worker  # One worker for both contexts.
      assert secure_total([4, 5]) == 9
      print('WORKER', worker.pid, worker.helper_pid, worker.log_path, flush=True)
  ''')
  _assert_clean_exit(returncode, out, err)
  pid, helper_pid, log = _marked(out, 'WORKER').split()
  for p in (pid, helper_pid):
    if p != 'None':
      assert processes.wait_gone(int(p)), f'{p} outlived its Python process'
  assert not os.path.exists(log)


def _digits_program_inputs(num_clients=4):
  """GMA in TFF's FedAvg on the embedded digits, logistic model, and a data source of client ids that
  `train_model` can deep-copy (the process builds each client's dataset itself, in the worker)."""
  train = digits.federated_train_data('iid', num_clients=num_clients, seed=0).preprocess(lambda ds: ds.batch(32))
  model_fn = models.model_fn(models.logistic_regression, train.element_type_structure)
  process = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, tff.learning.optimizers.build_sgdm(0.1),
      model_aggregator=aggregators.GradientMaskedFactory(tau=0.4),
      metrics_aggregator=tff.learning.metrics.secure_sum_then_finalize)
  program_process = tff.simulation.compose_dataset_computation_with_learning_process(
      train.dataset_computation, process)
  return process, program_process, tff.program.ClientIdDataSource(train.client_ids), train


def test_train_model_runs_gma_in_the_async_simulation_context(tmp_path, simulation_context):
  process, program_process, source, train = _digits_program_inputs()
  # What `train_model` does to the data source's iterator each round; TFF's `DatasetDataSource` over in-memory
  # datasets cannot take it (its datasets hold a graph), the client-id source can.
  copy.deepcopy(source.iterator())
  with pytest.raises(TypeError, match='pickle'):
    copy.deepcopy(tff.program.DatasetDataSource([train.create_tf_dataset_for_client(train.client_ids[0])]).iterator())
  initial = process.get_model_weights(process.initialize())  # In the suite's context.
  workers_before = set(runtime.state.STATE.live_workers)
  state_manager = tff.program.FileProgramStateManager(str(tmp_path / 'program_state'))
  model_output, train_metrics = tff.program.MemoryReleaseManager(), tff.program.MemoryReleaseManager()
  try:
    worker = runtime.set_async_simulation_context()
    assert worker is simulation_context and worker.confined == simulation_context.confined  # The same worker.
    asyncio.run(tff.learning.programs.train_model(
        train_process=program_process, train_data_source=source, train_per_round_clients=2, train_total_rounds=2,
        program_state_manager=state_manager, model_output_manager=model_output,
        train_metrics_manager=train_metrics, evaluation_manager=None, evaluation_periodicity=1))
  finally:
    runtime.set_simulation_context()
  assert set(runtime.state.STATE.live_workers) == workers_before  # No worker started beside the suite's.
  metrics = train_metrics.values()
  assert sorted(metrics) == [1, 2]
  for round_metrics in metrics.values():
    assert round_metrics['aggregator']['participating_clients'] == 2  # GMA's measurements: it ran.
    assert round_metrics['model_metrics']['num_examples'] > 0
  assert asyncio.run(state_manager.get_versions()) == [0, 1, 2]  # train_model saved every round, to resume.
  final_state = model_output.values()['training_checkpoint_round_2']
  final = process.get_model_weights(final_state)
  assert max(float(np.max(np.abs(a - b))) for a, b in zip(final.trainable, initial.trainable)) > 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Several workers.


def test_multi_worker_context_refuses_a_multi_stage_computation_when_it_is_invoked():
  train = digits.federated_train_data('iid', num_clients=2, seed=0).preprocess(lambda ds: ds.batch(32))
  model_fn = models.model_fn(models.logistic_regression, train.element_type_structure)
  rfa = tff.learning.algorithms.build_weighted_fed_avg(
      model_fn, tff.learning.optimizers.build_sgdm(0.1),
      model_aggregator=aggregators.GeometricMedianFactory(num_passes=3))
  state = rfa.initialize()
  datasets = [train.create_tf_dataset_for_client(c) for c in train.client_ids]
  workers = runtime.start_local_workers(1)
  try:
    runtime.set_multi_worker_context([w.target for w in workers])
    with pytest.raises(ValueError) as raised:
      rfa.next(state, datasets)  # Without `check_single_aggregation_stage` first.
  finally:
    runtime.set_simulation_context()
    for w in workers:
      w.stop()
  message = str(raised.value)
  assert '\n' not in message, message
  assert message.startswith('this computation aggregates in 3 sequential client-to-server stages')
  assert 'rfa_one_step' in message


# ----------------------------------------------------------------------------------------------------------------
# Exiting.


@pytest.mark.slow  # Child Pythons.
@pytest.mark.parametrize('script', [
    '''
    import tensorflow_federated as tff
    from tff_gma import runtime
    runtime.set_simulation_context()
    print('SUM', tff.federated_computation(lambda x: tff.federated_sum(x),
                                           tff.FederatedType(np.int32, tff.CLIENTS))([1, 2]))
    ''',
    '''
    import tensorflow_federated as tff
    from training import command_line
    sys.argv = ['a_command']
    command_line.run(lambda argv: print('RAN', flush=True))
    ''',
], ids=['library_context', 'entry_point'])
def test_a_script_that_runs_the_library_exits_clean(script):
  # TFF's import-time context's `__del__` ends a script that imported TFF with "Exception ignored in ... __del__
  # ... 'NoneType' object has no attribute 'Popen'", with or without this library. Where the library's own code
  # runs (its context, the project's commands), that context is collected while the interpreter is whole.
  _assert_clean_exit(*_run_child(script))
