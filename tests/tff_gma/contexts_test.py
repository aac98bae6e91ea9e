"""Which TFF execution context runs what (docs/runtime.md#contexts), and what a user's script sees without one.

* Forgetting `set_simulation_context()`: TFF's import-time context cannot run the secure sums; it fails in one line
  naming the fix, before any worker starts (`tff_gma/_default_context.py`), and still runs plain computations.
* TFF's own `set_sync_test_cpp_execution_context()` runs the factories (on TFF's unconfined worker).
* `set_async_simulation_context()`: the confined context TFF programs need; `tff.learning.programs.train_model`
  trains GMA in it.
* The multi-worker context refuses a multi-stage computation where it is invoked, in one line.
* A script that imports the library exits clean: no traceback from TFF's `__del__`, no worker left behind.

Tests that run a child Python are in the slow tier. Children run in their own process group, so that whatever they start (TFF's own worker included) is killed if a
test fails before it checks.
"""

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow_federated as tff

import tests
from tests.tff_gma import processes
from tff_gma import _default_context
from tff_gma import aggregators
from tff_gma import models
from tff_gma import runtime
from tff_gma.data import digits

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


def _run_child(code: str, timeout: float = 300):
  """Runs `code` (after `_HELPERS`) in a fresh Python; returns (returncode, stdout, stderr). Times out (and fails)
  if anything the child started keeps its pipes open after it ends."""
  child = subprocess.Popen([sys.executable, '-c', _HELPERS + textwrap.dedent(code)], cwd=tests.ROOT, env=_ENV,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True, preexec_fn=processes.default_signals)
  try:
    out, err = child.communicate(timeout=timeout)
  finally:
    try:
      os.killpg(child.pid, signal.SIGKILL)  # Whatever of the child's group is left (nothing, when all is well).
    except ProcessLookupError:
      pass
    child.wait()
  return child.returncode, out, err


def _assert_clean_exit(returncode, out, err):
  assert returncode == 0, err[-3000:]
  assert 'Traceback' not in err and 'Exception ignored' not in err, err[-3000:]


def _marked(out: str, marker: str) -> str:
  return next(l for l in out.splitlines() if l.startswith(marker + ' '))[len(marker) + 1:]


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


def test_forgotten_context_names_the_fix_in_one_line_before_any_worker_starts():
  process = aggregators.GradientMaskedFactory(tau=0.4).create(tff.TensorType(np.float32, [3]),
                                                               tff.TensorType(np.float32))
  state = process.initialize()  # In the suite's context.
  tffs_default = _default_context.NamedFixContext(tff.backends.native.create_sync_local_cpp_execution_context())
  before = _direct_children()
  with tff.framework.get_context_stack().install(tffs_default):
    with pytest.raises(RuntimeError) as raised:
      process.next(state, [np.array(v, np.float32) for v in _VALUES], _WEIGHTS)
  message = str(raised.value)
  assert '\n' not in message and len(message) < 400, message
  assert 'federated_secure_sum' in message and 'call tff_gma.runtime.set_simulation_context()' in message
  assert 'tff.backends.test.set_sync_test_cpp_execution_context()' in message
  assert _direct_children() == before  # Refused before TFF's worker was started.


def test_only_tffs_native_default_context_is_wrapped():
  stack = tff.framework.get_context_stack()
  try:
    stack.set_default_context(tff.backends.test.create_sync_test_cpp_execution_context())
    assert not _default_context.install()  # It runs the secure sums: left alone.
    runtime.set_simulation_context()
    assert not _default_context.install()  # This library's.
    native = tff.backends.native.create_sync_local_cpp_execution_context()
    stack.set_default_context(native)
    assert _default_context.install()  # TFF's import-time kind.
    assert isinstance(stack.current, _default_context.NamedFixContext) and stack.current.wrapped is native
    assert not _default_context.install()  # Not twice.
  finally:
    runtime.set_simulation_context()  # Back to the suite's context (the others are collected: no worker ran).


@pytest.mark.slow  # A child Python.
def test_a_script_that_forgets_the_context_gets_the_line_and_tffs_worker_does_not_outlive_it():
  # TFF imported first, then the library (either order installs the wrapper); plain computations still run on
  # TFF's context, and its worker is stopped at exit instead of outliving the script.
  returncode, out, err = _run_child('''
      import tensorflow_federated as tff
      import tff_gma.aggregators

      @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
      def secure_total(x):
        return tff.federated_secure_sum_bitwidth(x, 8)

      try:
        secure_total([1, 2, 3])
      except RuntimeError as e:
        print('REFUSED', str(e).splitlines()[-1], flush=True)
      print('WORKERS_AFTER_REFUSAL', json.dumps(tff_worker_children()), flush=True)

      @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
      def total(x):
        return tff.federated_sum(x)

      print('SUM', total([1, 2, 3]), flush=True)
      print('WORKERS', json.dumps(tff_worker_children()), flush=True)
  ''')
  _assert_clean_exit(returncode, out, err)
  assert _marked(out, 'REFUSED').startswith('this computation calls federated_secure_sum_bitwidth (secure '
                                            'aggregation), which TFF\'s default context cannot run: call '
                                            'tff_gma.runtime.set_simulation_context()')
  assert json.loads(_marked(out, 'WORKERS_AFTER_REFUSAL')) == []
  assert _marked(out, 'SUM') == '6'
  workers = json.loads(_marked(out, 'WORKERS'))
  assert len(workers) == 1
  assert processes.wait_gone(workers[0]), f"TFF's worker {workers[0]} outlived the script"


# ----------------------------------------------------------------------------------------------------------------
# TFF's own test context.


@pytest.mark.slow  # A child Python.
def test_tffs_test_context_runs_the_factories_on_its_own_unconfined_worker():
  returncode, out, err = _run_child(f'''
      import tensorflow_federated as tff
      tff.backends.test.set_sync_test_cpp_execution_context()
      print('RESULTS', json.dumps(run_factories({_FACTORIES!r}, {_VALUES!r}, {_WEIGHTS!r})), flush=True)
      print('WORKERS', json.dumps(tff_worker_children()), flush=True)
  ''')
  _assert_clean_exit(returncode, out, err)
  theirs = json.loads(_marked(out, 'RESULTS'))
  # The same factories in this library's simulation context (the suite's): the same results.
  namespace = {}
  exec(_HELPERS, namespace)  # pylint: disable=exec-used
  ours = namespace['run_factories'](_FACTORIES, _VALUES, _WEIGHTS)
  for name in _FACTORIES:
    np.testing.assert_allclose(theirs[name], ours[name], rtol=1e-6, atol=1e-6)
  assert not np.allclose(ours['gma'], np.average(_VALUES, axis=0, weights=_WEIGHTS))  # GMA masked something.
  # TFF's context started its worker binary itself: a direct child, listening on a TCP port of its own.
  workers = json.loads(_marked(out, 'WORKERS'))
  assert len(workers) == 1
  assert processes.wait_gone(workers[0]), f"TFF's worker {workers[0]} outlived the script"


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
  workers_before = set(runtime._live_workers)
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
  assert set(runtime._live_workers) == workers_before  # No worker started beside the suite's.
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
    'import tff_gma.models',
    '''
    import tensorflow as tf
    import tff_gma.models
    from tff_gma.data import digits
    split = digits.load_split()
    model = tff_gma.models.logistic_regression()
    model.compile(optimizer='sgd', loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=['accuracy'])
    history = model.fit(split.x_train, split.y_train, epochs=1, batch_size=64, verbose=0)
    print('ACCURACY', history.history['accuracy'][-1])
    ''',
], ids=['import', 'keras'])
def test_a_script_that_imports_the_library_exits_clean(script):
  # TFF's import-time context's `__del__` used to end such scripts with "Exception ignored in ... __del__ ...
  # 'NoneType' object has no attribute 'Popen'".
  _assert_clean_exit(*_run_child(script))
