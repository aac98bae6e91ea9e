"""Pins every TFF internal that tff_gma/tff_internals.py names: a TFF upgrade that moves one fails here, by name.

And keeps the rule that makes the module worth having: no other module of tff_gma/ or training/ imports TFF's
private modules or reads TFF's private attributes (the audit's building-block walker included).
"""

import ast
import collections
import gc
import os
import signal
import subprocess
import sys
import time

from absl.testing import absltest
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff
import tensorflow_privacy as tfp

import tests
from tff_gma import tff_internals


def _planted_worker(context):
  """The `ServiceManager` that TFF's local C++ executor factory closes over, for a context built by TFF 0.87."""
  context = getattr(context, '_context', context)
  context = getattr(context, '_async_context', context)
  stack_fn = context._executor_factory._executor_stack_fn  # pylint: disable=protected-access
  return dict(zip(stack_fn.__code__.co_freevars, stack_fn.__closure__))['service_manager'].cell_contents


def _secure_free_sum():
  @tff.federated_computation(tff.FederatedType(np.int32, tff.CLIENTS))
  def total(x):
    return tff.federated_sum(x)
  return total


# ---------------------------------------------------------------------------------------------------------------
# Execution contexts and the worker.


class AsyncThreadRunnerTest(absltest.TestCase):

  def test_it_runs_a_coroutine_from_synchronous_code(self):
    async def seven():
      return 7

    self.assertEqual(tff_internals.async_thread_runner().run_coro_and_return_result(seven()), 7)


class DefaultContextTest(absltest.TestCase):

  def test_it_is_the_bottom_of_the_stack_whatever_is_installed_over_it(self):
    stack = tff.framework.get_context_stack()
    original = tff_internals.default_context()
    self.assertIsNotNone(original)
    self.assertIs(original, stack.current)  # Nothing installed over it in this test.
    replacement = tff.test.create_runtime_error_context()
    try:
      with stack.install(tff.test.create_runtime_error_context()) as covering:
        self.assertIs(stack.current, covering)
        self.assertIs(tff_internals.default_context(), original)
        stack.set_default_context(replacement)
        self.assertIs(tff_internals.default_context(), replacement)
    finally:
      stack.set_default_context(original)
    self.assertIs(tff_internals.default_context(), original)


class CompilerFnOfTest(absltest.TestCase):

  def test_tffs_native_contexts_of_every_form_compile_with_the_native_compiler(self):
    native = tff.backends.native.desugar_and_transform_to_native
    contexts = [tff.backends.native.create_sync_local_cpp_execution_context(),
                tff.backends.native.create_async_local_cpp_execution_context(),
                tff.program.NativeFederatedContext(tff.backends.native.create_async_local_cpp_execution_context())]
    try:
      for context in contexts:
        self.assertIs(tff_internals.compiler_fn_of(context), native, type(context).__name__)
      self.assertIsNot(tff_internals.compiler_fn_of(tff.backends.test.create_sync_test_cpp_execution_context()),
                       native)
    finally:
      del contexts
      gc.collect()  # Their `__del__` (nothing started) now, not at interpreter shutdown.

  def test_a_context_built_with_a_compiler_gives_that_compiler_back(self):
    compiler = lambda comp: comp
    args = dict(executor_fn=tff.framework.ResourceManagingExecutorFactory(lambda cardinalities: None),
                compiler_fn=compiler)
    self.assertIs(tff_internals.compiler_fn_of(tff.framework.SyncExecutionContext(**args)), compiler)
    self.assertIs(tff_internals.compiler_fn_of(tff.framework.AsyncExecutionContext(**args)), compiler)
    self.assertIsNone(tff_internals.compiler_fn_of(tff.test.create_runtime_error_context()))
    self.assertIsNone(tff_internals.compiler_fn_of(object()))


class LocalCppWorkerProcessTest(absltest.TestCase):

  def test_it_reads_the_process_tffs_service_manager_holds_through_every_form(self):
    # Where TFF keeps the worker it started (the real start is the slow test below): planted, no process run.
    planted = object.__new__(subprocess.Popen)  # An instance, as TFF's is, of no process.
    contexts = [tff.backends.native.create_sync_local_cpp_execution_context(),
                tff.backends.test.create_sync_test_cpp_execution_context(),
                tff.program.NativeFederatedContext(tff.backends.native.create_async_local_cpp_execution_context())]
    try:
      for context in contexts:
        manager = _planted_worker(context)
        self.assertIsNone(manager._process)  # pylint: disable=protected-access  # Nothing started yet.
        self.assertIsNone(tff_internals.local_cpp_worker_process(context))
        manager._process = planted  # pylint: disable=protected-access
        try:
          self.assertIs(tff_internals.local_cpp_worker_process(context), planted, type(context).__name__)
        finally:
          manager._process = None  # pylint: disable=protected-access
    finally:
      del contexts
      gc.collect()
    self.assertIsNone(tff_internals.local_cpp_worker_process(tff.test.create_runtime_error_context()))
    self.assertIsNone(tff_internals.local_cpp_worker_process(None))

  @pytest.mark.slow  # Starts TFF's own (unconfined) worker binary.
  def test_after_a_computation_it_is_the_worker_tff_started(self):
    native = tff.backends.native.create_sync_local_cpp_execution_context()
    process = None
    try:
      with tff.framework.get_context_stack().install(native):
        self.assertEqual(_secure_free_sum()([1, 2, 3]), 6)
      process = tff_internals.local_cpp_worker_process(native)
      self.assertIsNotNone(process)
      self.assertIsNone(process.poll())
      self.assertEqual(os.path.basename(process.args[0]), 'worker_binary')
    finally:
      if process is not None:
        # Stopped as the runtime stops it: killed, left for TFF's `__del__` to reap (which it does on collection).
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(process.pid) not in ('Z', None) and time.monotonic() < deadline:
          time.sleep(0.01)
      del native
      gc.collect()
    if process is not None:
      self.assertIsNotNone(process.returncode)  # Reaped by TFF's `__del__`.


def _state(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rpartition(')')[2].split()[0]
  except OSError:
    return None


# ---------------------------------------------------------------------------------------------------------------
# The audit.


class IntrinsicDefinitionsTest(absltest.TestCase):

  def test_tffs_intrinsics_are_known_and_the_secure_ones_are_marked(self):
    for uri in ('federated_sum', 'federated_mean', 'federated_secure_sum_bitwidth', 'federated_select'):
      self.assertTrue(tff_internals.is_known_intrinsic(uri), uri)
    self.assertFalse(tff_internals.is_known_intrinsic('custom_gather'))
    secure = ('federated_secure_sum', 'federated_secure_sum_bitwidth', 'federated_secure_modular_sum',
              'federated_secure_select')
    for uri in secure:
      self.assertTrue(tff_internals.is_secure_intrinsic(uri), uri)
    for uri in ('federated_sum', 'federated_mean', 'federated_select', 'federated_broadcast', 'custom_gather'):
      self.assertFalse(tff_internals.is_secure_intrinsic(uri), uri)


class IsPolymorphicComputationTest(absltest.TestCase):

  def test_an_untyped_computation_is_one_and_is_no_tff_computation(self):
    untyped = tff.federated_computation(lambda x: x)
    self.assertTrue(tff_internals.is_polymorphic_computation(untyped))
    self.assertNotIsInstance(untyped, tff.Computation)  # Why the audit needs the name: TFF's public type excludes it.
    self.assertFalse(tff_internals.is_polymorphic_computation(tff.federated_computation(lambda x: x, np.int32)))
    self.assertFalse(tff_internals.is_polymorphic_computation(lambda x: x))


# ---------------------------------------------------------------------------------------------------------------
# Aggregators.

_SUM_SLOT_CLASSES = (tff.aggregators.DifferentiallyPrivateFactory, tff.aggregators.MeanFactory,
                     tff.aggregators.UnweightedMeanFactory)
_FLOATS = tff.TensorType(np.float32, [2])


class _Spy(tff.aggregators.UnweightedAggregationFactory):
  """A sum that records which of `_SUM_SLOT_CLASSES` is creating it."""

  def __init__(self):
    self.seen = []

  def create(self, value_type):
    frame = sys._getframe()  # pylint: disable=protected-access
    self.seen.append(tff_internals.create_running_above(frame, _SUM_SLOT_CLASSES))
    return tff.aggregators.SumFactory().create(value_type)


class CreateRunningAboveTest(absltest.TestCase):

  def test_each_sum_slot_creates_its_inner_factory_from_its_own_create(self):
    creates = {
        tff.aggregators.DifferentiallyPrivateFactory: lambda spy: tff.aggregators.DifferentiallyPrivateFactory(
            tfp.GaussianSumQuery(l2_norm_clip=1.0, stddev=0.0), record_aggregation_factory=spy).create(_FLOATS),
        tff.aggregators.MeanFactory: lambda spy: tff.aggregators.MeanFactory(value_sum_factory=spy).create(
            _FLOATS, tff.TensorType(np.float32)),
        tff.aggregators.UnweightedMeanFactory: lambda spy: tff.aggregators.UnweightedMeanFactory(
            value_sum_factory=spy).create(_FLOATS),
    }
    for factory, create in creates.items():
      spy = _Spy()
      create(spy)
      self.assertEqual(spy.seen, [factory])

  def test_behind_another_factory_it_is_still_found_and_elsewhere_nothing_is(self):
    spy = _Spy()
    tff.aggregators.MeanFactory(value_sum_factory=tff.aggregators.clipping_factory(1.0, spy)).create(
        _FLOATS, tff.TensorType(np.float32))
    self.assertEqual(spy.seen, [tff.aggregators.MeanFactory])
    spy = _Spy()
    spy.create(_FLOATS)  # Created directly.
    tff.aggregators.clipping_factory(1.0, spy).create(_FLOATS)  # By a factory that is not a sum slot.
    self.assertEqual(spy.seen, [None, None])


# ---------------------------------------------------------------------------------------------------------------
# Learning processes, models and data.


def _one_weight_model_fn():
  keras_model = tf.keras.Sequential([tf.keras.layers.Dense(1, use_bias=False, input_shape=(1,))])
  spec = collections.OrderedDict(x=tf.TensorSpec([None, 1], tf.float32), y=tf.TensorSpec([None, 1], tf.float32))
  return tff.learning.models.from_keras_model(keras_model, loss=tf.keras.losses.MeanSquaredError(), input_spec=spec)


class ModelDeltaUpdateTest(absltest.TestCase):

  def test_one_sgd_step_gives_the_delta_and_example_count_by_hand(self):
    update = tff_internals.build_model_delta_update_with_tff_optimizer(
        _one_weight_model_fn, weighting=tff.learning.ClientWeighting.NUM_EXAMPLES,
        loop_implementation=tff.learning.LoopImplementation.DATASET_REDUCE)
    data = tf.data.Dataset.from_tensor_slices(collections.OrderedDict(
        x=np.array([[1.0], [3.0]], np.float32), y=np.array([[0.0], [1.0]], np.float32))).batch(2)
    weights = tff.learning.models.ModelWeights(trainable=[np.array([[2.0]], np.float32)], non_trainable=[])
    result, _ = update(tff.learning.optimizers.build_sgdm(learning_rate=0.1), weights, data)
    # Loss mean((w x - y)^2) over the batch: its gradient mean(2 (w x - y) x) = (2*2*1 + 2*5*3) / 2 = 17, and the
    # delta of one SGD step is lr * gradient (initial minus trained weights).
    np.testing.assert_allclose(result.update[0], [[1.7]], rtol=1e-6)
    self.assertEqual(float(result.update_weight), 2.0)  # Two examples.


class KerasModelOfTest(absltest.TestCase):

  def test_it_is_the_keras_model_from_keras_model_wraps(self):
    keras_model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
    spec = collections.OrderedDict(x=tf.TensorSpec([None, 1], tf.float32), y=tf.TensorSpec([None, 1], tf.float32))
    model = tff.learning.models.from_keras_model(keras_model, loss=tf.keras.losses.MeanSquaredError(),
                                                 input_spec=spec)
    self.assertIs(tff_internals.keras_model_of(model), keras_model)
    self.assertIsNone(tff_internals.keras_model_of(keras_model))


# ---------------------------------------------------------------------------------------------------------------
# The rule: nothing else reaches into TFF.

# The one file allowed to: this module.
_EXEMPT = frozenset({'tff_gma/tff_internals.py'})
# TFF's private attributes that tff_internals reads, and the frame and closure inspection it does: read anywhere
# else (other than on `self` or `cls`, a class's own), they mean TFF's internals are reached around this module.
_PRIVATE_ATTRIBUTES = frozenset({'_stack', '_context', '_async_context', '_compiler_pipeline', '_compiler_fn',
                                 '_executor_factory', '_executor_stack_fn', '_keras_model', 'f_code',
                                 'cell_contents', '__closure__'})


def _reaches_into_tff(tree: ast.AST) -> list[tuple[int, str]]:
  """(line, what) for each import of `tensorflow_federated.python` and each read of `_PRIVATE_ATTRIBUTES`."""
  private = 'tensorflow_federated.python'
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(node.lineno, f'import {a.name}') for a in node.names if a.name.startswith(private)]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
      names = [f'{node.module}.{a.name}' for a in node.names]
      if any(n.startswith(private) for n in [node.module] + names):
        found.append((node.lineno, f'from {node.module} import ...'))
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(private):
      found.append((node.lineno, repr(node.value)))  # importlib.import_module('tensorflow_federated.python...').
    elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRIBUTES and not (
        isinstance(node.value, ast.Name) and node.value.id in ('self', 'cls')):
      found.append((node.lineno, f'.{node.attr}'))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ('getattr', 'setattr', 'hasattr', 'delattr') and len(node.args) >= 2
          and isinstance(node.args[1], ast.Constant) and node.args[1].value in _PRIVATE_ATTRIBUTES):
      found.append((node.lineno, f'{node.func.id}(..., {node.args[1].value!r})'))
  return found


def _sources():
  for top in ('tff_gma', 'training'):
    for directory, _, names in os.walk(os.path.join(tests.ROOT, top)):
      for name in sorted(names):
        if name.endswith('.py'):
          path = os.path.join(directory, name)
          yield os.path.relpath(path, tests.ROOT).replace(os.sep, '/'), path


class OnlyThisModuleReachesIntoTffTest(absltest.TestCase):

  def test_no_other_module_imports_tffs_private_modules_or_reads_its_private_attributes(self):
    offenders = []
    for relative, path in _sources():
      if relative in _EXEMPT:
        continue
      with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), filename=path)
      offenders += [f'{relative}:{line}: {what}' for line, what in _reaches_into_tff(tree)]
    self.assertEmpty(offenders, 'TFF internals used outside tff_gma/tff_internals.py (put each there, named and '
                                'pinned in this test file):\n' + '\n'.join(offenders))

  def test_the_scan_finds_each_kind_of_reach(self):
    source = '\n'.join([
        'import tensorflow_federated.python.core as a',
        'from tensorflow_federated.python.core.impl import building_blocks',
        'from tensorflow_federated import python',
        "importlib.import_module('tensorflow_federated.python.learning')",
        'stack._stack[0]',
        "getattr(model, '_keras_model', None)",
        'frame.f_code',
        'self._keras_model(x)',  # A class's own attribute: not TFF's.
        'import tensorflow_federated as tff',
        'from tensorflow_federated.proto.v0 import computation_pb2',
    ])
    self.assertEqual(sorted(line for line, _ in _reaches_into_tff(ast.parse(source))), [1, 2, 3, 4, 5, 6, 7])
    self.assertTrue(os.path.isfile(os.path.join(tests.ROOT, 'tff_gma', 'tff_internals.py')))
    self.assertTrue(all(os.path.isfile(os.path.join(tests.ROOT, p)) for p in _EXEMPT), 'an exempt file moved')


if __name__ == '__main__':
  absltest.main()
