"""The one line a TFF user reads when a process with the library's secure sums is built under a context that cannot
run them (`tff_gma.aggregators.context_check`, docs/runtime.md#troubleshooting).

* A script that composes a factory into TFF's `build_weighted_fed_avg` under TFF's default context and calls `next`:
  one warning line, pointing at the script's builder call, naming the intrinsic and `set_simulation_context()`.
* No warning under the library's simulation and multi-worker contexts, TFF's test context, or the runtime-error
  context the project's entry points install; one per process under TFF's native context, however many factories.
* Importing the library changes no TFF context and no warning filter.

Children run in their own session, with their output in files: TFF's default context leaves its worker running
(holding the child's output) after a failed computation, and the session is killed afterwards.
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import tests
from tests.tff_gma import processes
from tff_gma import aggregators
from tff_gma import runtime
from tff_gma import tff_internals
from tff_gma.aggregators import context_check
from tff_gma.runtime import contexts
from tff_gma.runtime import multi_worker

_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')

# A user's script: a tiny Keras model, TFF's own FedAvg builder with the library's GMA and RFA (two factories, one
# warning), then one round, which TFF's default context cannot run.
_USER_SCRIPT = '''\
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
import tff_gma.aggregators

def model_fn():
  keras = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(2,)), tf.keras.layers.Dense(1)])
  return tff.learning.models.from_keras_model(
      keras, loss=tf.keras.losses.MeanSquaredError(),
      input_spec=(tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([None, 1], tf.float32)))

build, sgd = tff.learning.algorithms.build_weighted_fed_avg, tff.learning.optimizers.build_sgdm(0.1)
process = build(model_fn, client_optimizer_fn=sgd, model_aggregator=tff_gma.aggregators.GradientMaskedFactory())
rfa = tff_gma.aggregators.GeometricMedianFactory(num_passes=2, secure=True, value_bound=10.0)
build(model_fn, client_optimizer_fn=sgd, model_aggregator=rfa)
print('BUILT', flush=True)
data = [tf.data.Dataset.from_tensor_slices((np.ones([4, 2], np.float32), np.ones([4, 1], np.float32))).batch(2)] * 3
try:
  process.next(process.initialize(), data)
  print('RAN', flush=True)
except Exception as e:  # TFF's gRPC error: the script only says that it came.
  print('FAILED', type(e).__name__, flush=True)
'''
_BUILDER_LINE = 1 + next(  # The line that builds the first process.
    i for i, line in enumerate(_USER_SCRIPT.splitlines()) if line.startswith('process = build('))


def _run_script(path, timeout: float = 300) -> tuple[int, str, str]:
  """Runs the Python file `path` in its own session, output to files; returns (returncode, stdout, stderr) once
  it ends, after killing whatever of its session is left (TFF's orphaned worker)."""
  out_path, err_path = f'{path}.out', f'{path}.err'
  with open(out_path, 'w') as out, open(err_path, 'w') as err:
    child = subprocess.Popen([*processes.DEFAULT_SIGNALS, sys.executable, str(path)], cwd=tests.ROOT, env=_ENV,
                             stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
  try:
    child.wait(timeout=timeout)
  finally:
    processes.kill_session(child.pid)
    child.wait()
  with open(out_path) as out, open(err_path) as err:
    return child.returncode, out.read(), err.read()


def _warning_lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if 'SecureSumContextWarning' in line]


# ----------------------------------------------------------------------------------------------------------------
# The user's first contact.


@pytest.mark.slow  # A child Python that builds two FedAvg processes and fails one round (about 20 s).
def test_a_script_under_tffs_default_context_reads_one_line_naming_the_intrinsic_and_the_fix(tmp_path):
  script = tmp_path / 'user_script.py'
  script.write_text(_USER_SCRIPT)
  returncode, out, err = _run_script(script)
  assert returncode == 0, err[-3000:]
  assert 'BUILT' in out and 'FAILED' in out, out + err[-3000:]  # TFF's own error still comes from `next`.
  lines = _warning_lines(err)
  assert len(lines) == 1, err[-5000:]  # Once per process, not per factory or per secure sum.
  line = lines[0]
  assert line.startswith(f'{script}:{_BUILDER_LINE}: SecureSumContextWarning: '), line  # The script's own line.
  assert 'federated_secure_sum' in line and 'tff_gma.runtime.set_simulation_context()' in line, line
  assert 'tff.backends.test.set_sync_test_cpp_execution_context()' in line, line


# ----------------------------------------------------------------------------------------------------------------
# Which contexts warn (tracing only: nothing runs, no worker starts).


def _warnings_while(build, default_context, monkeypatch) -> list[warnings.WarningMessage]:
  """The `SecureSumContextWarning`s issued while `build()` runs with `default_context` as TFF's default context
  (the one before restored), as in a fresh process."""
  monkeypatch.setattr(context_check, '_warned', False)
  stack = tff.framework.get_context_stack()
  saved = tff_internals.default_context()
  stack.set_default_context(default_context)
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      build()
  finally:
    stack.set_default_context(saved)
  return [w for w in caught if issubclass(w.category, context_check.SecureSumContextWarning)]


def _traced_warnings(default_context, monkeypatch, factories=None) -> list[warnings.WarningMessage]:
  """`_warnings_while` `factories` (default: GMA, which traces both of the check's call sites) are created."""

  def create_all():
    for factory in factories or [aggregators.GradientMaskedFactory()]:
      factory.create(tff.TensorType(np.float32, [3]), tff.TensorType(np.float32))

  return _warnings_while(create_all, default_context, monkeypatch)


def _multi_worker_context():
  """The multi-worker context as `set_multi_worker_context` builds it, over one address nothing is asked of."""
  return multi_worker.create_context(['127.0.0.1:9'])


def test_tffs_native_context_warns_once_for_every_factory_and_names_the_fix(monkeypatch):
  factories = [aggregators.GradientMaskedFactory(), aggregators.SecureWeightedMeanFactory(10.0)]
  caught = _traced_warnings(tff.backends.native.create_sync_local_cpp_execution_context(), monkeypatch, factories)
  assert len(caught) == 1, [str(w.message) for w in caught]
  assert str(caught[0].message) == context_check.message('federated_secure_sum')
  assert '\n' not in str(caught[0].message)
  assert caught[0].filename == __file__  # This test's own line, not the library's or TFF's.


def test_tffs_native_program_context_warns_too(monkeypatch):
  native_program = tff.program.NativeFederatedContext(tff.backends.native.create_async_local_cpp_execution_context())
  assert len(_traced_warnings(native_program, monkeypatch)) == 1


@pytest.mark.parametrize('name', ['simulation', 'async_simulation', 'tff_test', 'multi_worker', 'runtime_error'])
def test_contexts_that_run_secure_sums_or_nothing_do_not_warn(name, monkeypatch):
  worker = runtime.set_simulation_context()  # Already installed by the session's fixture; the call keeps its worker.
  context = {
      'simulation': tff_internals.default_context,
      # What `set_async_simulation_context` installs, on the same worker.
      'async_simulation': lambda: tff.program.NativeFederatedContext(contexts.create_async_simulation_context(worker)),
      'tff_test': tff.backends.test.create_sync_test_cpp_execution_context,
      'multi_worker': _multi_worker_context,
      'runtime_error': tff.test.create_runtime_error_context,  # What `runtime.set_up_entry_point` installs.
  }[name]()
  assert _traced_warnings(context, monkeypatch) == []


def _tiny_model_fn():
  keras = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(2,)), tf.keras.layers.Dense(1)])
  return tff.learning.models.from_keras_model(
      keras, loss=tf.keras.losses.MeanSquaredError(),
      input_spec=(tf.TensorSpec([None, 2], tf.float32), tf.TensorSpec([None, 1], tf.float32)))


@pytest.mark.slow  # Builds and runs a FedAvg round (a few seconds).
def test_a_round_under_the_simulation_context_runs_without_the_warning(monkeypatch):
  monkeypatch.setattr(context_check, '_warned', False)
  runtime.set_simulation_context()
  data = [tf.data.Dataset.from_tensor_slices((np.ones([4, 2], np.float32), np.ones([4, 1], np.float32))).batch(2)]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    process = tff.learning.algorithms.build_weighted_fed_avg(
        _tiny_model_fn, client_optimizer_fn=tff.learning.optimizers.build_sgdm(0.1),
        model_aggregator=aggregators.GradientMaskedFactory())
    output = process.next(process.initialize(), data * 3)
  assert output.metrics['aggregator']['participating_clients'] == 3
  assert not [w for w in caught if issubclass(w.category, context_check.SecureSumContextWarning)]


# ----------------------------------------------------------------------------------------------------------------
# Importing.

_IMPORT_CHECK = textwrap.dedent('''
    import json, pkgutil, warnings
    import tensorflow_federated as tff
    from tff_gma import tff_internals

    def snapshot():
      stack = tff.framework.get_context_stack()
      return {'current': id(stack.current), 'default': id(tff_internals.default_context()),
              'default_type': type(tff_internals.default_context()).__name__,
              'filters': [repr(f) for f in warnings.filters]}

    before = snapshot()
    import tff_gma
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      for info in pkgutil.walk_packages(tff_gma.__path__, 'tff_gma.'):
        if not info.name.endswith('.__main__'):
          __import__(info.name)
    from tff_gma.aggregators import context_check
    print('RESULT', json.dumps({'before': before, 'after': snapshot(), 'warned': context_check._warned,
                                'warnings': [str(w.message) for w in caught if 'secure' in str(w.message)]}))
''')


@pytest.mark.slow  # A child Python.
def test_importing_the_library_changes_no_tff_context_and_no_warning_filter(tmp_path):
  script = tmp_path / 'import_check.py'
  script.write_text(_IMPORT_CHECK)
  returncode, out, err = _run_script(script)
  assert returncode == 0, err[-3000:]
  result = json.loads(next(line for line in out.splitlines() if line.startswith('RESULT '))[len('RESULT '):])
  assert result['after'] == result['before']  # The same context objects, the same warning filters.
  assert result['before']['default_type'] == 'SyncExecutionContext'  # TFF's own import-time context.
  assert result['warned'] is False and result['warnings'] == []


@pytest.mark.slow  # Builds a learning process (a few seconds).
def test_the_runner_builds_without_the_warning_it_answers_itself(monkeypatch, tmp_path):
  """The runner installs its context after building and refuses a wrong one in one line (`check_context_runs`):
  called from Python under TFF's native default context, its build must not warn."""
  from training import config as config_lib  # pylint: disable=g-import-not-at-top
  from training.runner import experiment  # pylint: disable=g-import-not-at-top
  config = config_lib.ExperimentConfig(rounds=1, aggregator='gma', output_dir=str(tmp_path), num_clients=4,
                                       clients_per_round=2)
  native = tff.backends.native.create_sync_local_cpp_execution_context()
  assert _warnings_while(lambda: experiment.build_setup_quietly(config), native, monkeypatch) == []
