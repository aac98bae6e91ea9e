"""Several TFF workers per round: TFF's mergeable-computation runtime over workers this process may not own.

Each round's clients are split over the workers at the given targets (TFF's mergeable form, run through TFF's
executor interface on each worker, the secure intrinsics lowered before the split). TFF's mergeable form runs one
aggregation stage per computation: a multi-pass aggregate runs as one computation per pass
(`GeometricMedianFactory.create_staged`), and a computation of several stages is refused by name, before TFF would
fail on it with a dump of its building blocks. `start_local_workers` starts owned workers on this host for it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

import grpc
import tensorflow_federated as tff

from tff_gma import tff_internals
from tff_gma.runtime import contexts
from tff_gma.runtime import files
from tff_gma.runtime import worker_process
from tff_gma.runtime.worker_process import WorkerProcess

CONNECT_TIMEOUT_S = 10.0  # For workers this process does not own (`set_multi_worker_context`).


class _WorkerCalls:
  """One worker, driven through TFF's executor interface: its executors (TFF's factory keeps one per client
  count) on an event loop in a thread of its own, and the computations already sent to each executor.

  TFF's `AsyncExecutionContext` sends a computation with every call and fetches every result into this process;
  here a computation is sent once to an executor, and a value a later call on the same worker takes (its share of
  the argument, its partial aggregate) stays on the worker. TFF's `RemoteExecutor` makes blocking gRPC calls
  inside its coroutines, so each worker's coroutines run on a loop of their own: gathered on one loop they would
  run one after the other.
  """

  SENT_COMPUTATIONS = 64  # Per worker; an evicted one is disposed of on the worker (its value's finalizer).

  def __init__(self, factory):
    self._factory = factory
    self._runner = tff_internals.async_thread_runner()
    self._sent = collections.OrderedDict()  # (id(executor), id(comp)) -> (executor, comp, its value there)
    self._cardinalities = []  # Those of the executors in use since the last reset.

  def run(self, coro):
    return self._runner.run_coro_and_return_result(coro)

  def executor(self, clients: Optional[int]):
    cardinalities = {} if clients is None else {tff.CLIENTS: clients}
    if cardinalities not in self._cardinalities:
      self._cardinalities.append(cardinalities)
    return self._factory.create_executor(dict(cardinalities))

  async def computation(self, executor, comp):
    """`comp`'s value in `executor`, sent there on its first use (keyed by identity: a computation's hash
    serializes it)."""
    key = (id(executor), id(comp))
    if key in self._sent:
      self._sent.move_to_end(key)
      return self._sent[key][2]
    value = await executor.create_value(comp, comp.type_signature)
    self._sent[key] = (executor, comp, value)
    while len(self._sent) > self.SENT_COMPUTATIONS:
      self._sent.popitem(last=False)
    return value

  def reset(self) -> None:
    """Forgets this worker's executors and what was sent to them (after a failed call, as TFF's context does)."""
    self._sent.clear()
    for cardinalities in self._cardinalities:
      self._factory.clean_up_executor(dict(cardinalities))
    self._cardinalities = []


@dataclasses.dataclass
class _Share:
  """What one worker holds of a call: its executor, its share of the argument and its partial aggregate (values
  on the worker), and the partial fetched into this process where another worker takes it."""
  executor: Any
  arg: Any
  partial: Any
  fetched: Any = None


class _MergeableContext(tff.framework.SyncContext):
  """TFF's mergeable-computation runtime over several workers: a computation compiled to TFF's `MergeableCompForm`,
  its `up_to_merge` run on every worker on a contiguous share of the clients, the partial aggregates merged in the
  shares' order and `after_merge` run once (or on every worker, for a result with per-client values, joined in
  the shares' order).

  Not TFF's `MergeableCompExecutionContext`, which merges the partials and concatenates the workers' per-client
  results in the order the workers finish (a later worker finishing first gives its clients' results to the
  first worker's clients; with three workers or more the sums' last bits change from run to run), sends the
  argument again to `after_merge`, and loses the result's Python containers (a learning process's `next` would
  return an OrderedDict instead of a `LearningProcessOutput`).

  The workers take their shares one after the other (each share's serialization holds this process's interpreter
  lock, so sent side by side they would all arrive as late as the last), and each starts as soon as its share has
  arrived. A worker that fails with TFF's `RetryableError` (unreachable) fails the call, which is retried whole,
  as TFF's own contexts retry a call: without end, waits doubling from 1 ms to 30 s (the runner bounds it with
  its worker deadline, `training.runner.worker_deadline`).
  """

  RETRY_WAIT_MAX_S = 30.0

  def __init__(self, executor_factories, mergeable_compiler_fn, native_compiler_fn):
    self._workers = [_WorkerCalls(f) for f in executor_factories]
    self._to_mergeable = mergeable_compiler_fn
    self._to_native = native_compiler_fn
    self._forms = {}  # id(computation) -> (computation, its mergeable form)
    self._natives = {}  # id(computation) -> (computation, compiled for the workers)
    self._merged_afters = {}  # (id(form), partials) -> (form, `_merge_then_after_merge` of it)
    # The last invocation's wall seconds by stage (split, up_to_merge, merge_and_after_merge, result_containers,
    # invoke): what the benchmark's breakdown reads (`training.bench.multi_worker`).
    self.last_stages = {}

  def invoke(self, comp, arg=None):
    began = time.perf_counter()
    self.last_stages = {}
    form = self._form(comp) if isinstance(comp, tff.Computation) else comp
    slices = [None] * len(self._workers)
    if arg is not None:
      slices = _split(_to_numpy(arg), form.up_to_merge.type_signature.parameter, len(self._workers))
    self._stage('split', began)
    result = self._retried(form, slices)
    converted = time.perf_counter()
    result_type = (comp if isinstance(comp, tff.Computation) else form.after_merge).type_signature.result
    result = tff.types.type_to_py_container(_as_structs(result, result_type), result_type)
    self._stage('result_containers', converted)
    self._stage('invoke', began)
    return result

  def _stage(self, name: str, began: float) -> None:
    self.last_stages[name] = self.last_stages.get(name, 0.0) + time.perf_counter() - began

  def _form(self, comp):
    return _memo(self._forms, id(comp), comp, lambda: self._to_mergeable(comp))

  def _native(self, comp):
    """`comp` compiled for the workers once, for all of them."""
    return _memo(self._natives, id(comp), comp, lambda: self._to_native(comp))

  def _merged_after(self, form, parts: int):
    """`form`'s merge of `parts` partial aggregates, in their order, then its `after_merge`: one computation."""
    if parts == 1:
      return form.after_merge
    return _memo(self._merged_afters, (id(form), parts), form, lambda: _merge_then_after_merge(form, parts))

  def _retried(self, form, slices):
    """`_run_form`, again after a `RetryableError`; after any error, the workers' executors forgotten (as TFF's
    contexts reset their executor factory)."""
    wait = 0.001
    while True:
      try:
        return self._run_form(form, slices)
      except BaseException as e:
        for worker in self._workers[:len(slices)]:
          worker.reset()
        if not isinstance(e, tff.framework.RetryableError):
          raise
      time.sleep(wait)
      wait = min(self.RETRY_WAIT_MAX_S, 2 * wait)

  def _run_form(self, form, slices):
    """`form` on the argument's slices, one a worker, merged and joined in the slices' order."""
    began = time.perf_counter()
    up_to_merge = self._native(form.up_to_merge)
    result_type = form.after_merge.type_signature.result
    per_client = _has_client_values(result_type)
    after = self._native(self._merged_after(form, len(slices)))
    turns = [threading.Event() for _ in range(len(slices) + 1)]
    turns[0].set()
    # A partial crosses to the worker that runs `after_merge` (the first), or to every worker where each runs it.
    crosses = lambda i: len(slices) > 1 and (per_client or i > 0)

    def share_on(i: int) -> _Share:
      try:
        return self._workers[i].run(
            self._up_to_merge(self._workers[i], up_to_merge, slices[i], turns[i], turns[i + 1], crosses(i)))
      finally:
        turns[i + 1].set()  # Also where the call failed before its share was sent: the next worker goes on.

    shares = self._on_each(share_on, len(slices))
    self._stage('up_to_merge', began)
    began = time.perf_counter()
    partial_type = form.up_to_merge.type_signature.result
    after_on = lambda i: self._workers[i].run(self._after_merge(self._workers[i], after, shares, i, partial_type))
    if per_client:
      result = _joined(self._on_each(after_on, len(slices)), result_type)
    else:
      # Nothing placed at the clients comes back, so it runs once, where its share of the argument already is.
      result = after_on(0)
    self._stage('merge_and_after_merge', began)
    return result

  @staticmethod
  async def _up_to_merge(worker, comp, arg, turn, next_turn, fetch: bool) -> _Share:
    turn.wait()  # This worker's event loop only: it waits for the previous worker's share to be sent.
    try:
      executor = worker.executor(None if arg is None else _client_count(arg, comp.type_signature.parameter))
      comp_value = await worker.computation(executor, comp)
      arg_value = None if arg is None else await executor.create_value(arg, comp.type_signature.parameter)
    finally:
      next_turn.set()
    partial = await executor.create_call(comp_value, arg_value)
    return _Share(executor, arg_value, partial, await partial.compute() if fetch else None)

  @staticmethod
  async def _after_merge(worker, comp, shares: list, index: int, partial_type):
    """`comp` (`after_merge`, with the merges where there are several partials) on worker `index`: its own share
    and partial as they are on it, the other workers' partials sent to it."""
    own = shares[index]
    executor = own.executor
    elements = [] if own.arg is None else [own.arg]
    for i, share in enumerate(shares):
      elements.append(own.partial if i == index else await executor.create_value(share.fetched, partial_type))
    arg = elements[0] if len(elements) == 1 else await executor.create_struct(tff.structure.Struct.unnamed(*elements))
    comp_value = await worker.computation(executor, comp)
    result = await executor.create_call(comp_value, arg)
    return tff.tensorflow.transform_result(await result.compute())

  @staticmethod
  def _on_each(call, count: int) -> list:
    """`call(i)` for i < count, side by side, one thread each; the results in order."""
    if count == 1:
      return [call(0)]
    # Daemon threads, not a ThreadPoolExecutor: its threads are joined at exit, so a call blocked on a stopped worker
    # would keep the process from exiting after the caller gave up on it (the runner's worker deadline).
    outcomes = [{} for _ in range(count)]

    def run(i: int) -> None:
      try:
        outcomes[i]['value'] = call(i)
      except BaseException as e:  # pylint: disable=broad-except
        outcomes[i]['error'] = e

    threads = [threading.Thread(target=run, args=(i,), name=f'tff_gma_worker_call_{i}', daemon=True)
               for i in range(count)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    for outcome in outcomes:
      if 'error' in outcome:
        raise outcome['error']
    return [outcome['value'] for outcome in outcomes]

def _memo(table: dict, key, keep, make):
  """`table[key]`'s value, made by `make()` on first use; `keep` is held beside it, so that an `id` in `key` stays
  its object's (identity keys: a computation's hash serializes it)."""
  if key not in table:
    table[key] = (keep, make())
  return table[key][1]


def _merge_then_after_merge(form, parts: int) -> tff.Computation:
  """`<arg, partial_1, ..., partial_parts> -> form.after_merge(arg, merged)` (no `arg` where `up_to_merge` takes
  none), the partials merged left to right with `form.merge`, as the workers' results would be one by one."""
  partial_type = form.up_to_merge.type_signature.result
  arg_type = form.up_to_merge.type_signature.parameter
  leading = [] if arg_type is None else [arg_type]
  merge = form.merge

  @tff.federated_computation(tff.StructType(leading + [partial_type] * parts))
  def merge_then_after_merge(args):
    merged = args[len(leading)]
    for i in range(len(leading) + 1, len(leading) + parts):
      merged = tff.federated_map(merge, tff.federated_zip((merged, args[i])))
    return form.after_merge(merged) if arg_type is None else form.after_merge(args[0], merged)

  return merge_then_after_merge


def _per_client(value_type) -> bool:
  """Whether `value_type` is placed at CLIENTS with a value per client (not all-equal)."""
  return isinstance(value_type, tff.FederatedType) and value_type.placement is tff.CLIENTS and not value_type.all_equal


def _elements(value) -> list:
  """A structure's elements, (name, value) pairs, from any container TFF takes for a struct."""
  if isinstance(value, tff.structure.Struct):
    return tff.structure.to_elements(value)
  if isinstance(value, dict):
    return list(value.items())
  if isinstance(value, (list, tuple)) and not hasattr(value, '_fields'):
    return [(None, v) for v in value]
  return tff.structure.to_elements(tff.structure.from_container(value))  # A namedtuple, attrs or dataclass.


def _client_count(value, value_type) -> Optional[int]:
  """The number of clients of the first CLIENTS-placed value that differs between clients, or None."""
  if _per_client(value_type):
    return len(value)
  if isinstance(value_type, tff.StructType):
    counts = (_client_count(v, t) for (_, v), t in zip(_elements(value), value_type))
    return next((c for c in counts if c is not None), None)
  return None


def _sliced(value, value_type, start: int, stop: int):
  """`value` with each CLIENTS-placed value cut to its clients [start, stop); every other value whole."""
  if _per_client(value_type):
    return value[start:stop]
  if isinstance(value_type, tff.StructType):
    return tff.structure.Struct(
        [(name, _sliced(v, t, start, stop)) for (name, v), t in zip(_elements(value), value_type)])
  return value


def _split(value, value_type, workers: int) -> list:
  """`value` as one slice per worker, each with a contiguous share of the clients (as TFF splits them; a worker
  left without clients gets no slice). TFF's own split loses its place after a struct's last element when that
  element is not placed at CLIENTS, and gives every worker the first clients."""
  count = _client_count(value, value_type)
  if count is None:
    return [value] * workers
  sizes = [count // workers + (i < count % workers) for i in range(workers)]
  starts = [sum(sizes[:i]) for i in range(workers)]
  return [_sliced(value, value_type, a, a + n) for a, n in zip(starts, sizes) if n]


def _joined(results: list, value_type):
  """The workers' results as one: CLIENTS-placed values concatenated in the workers' order, others the first's."""
  if _per_client(value_type):
    return [client for result in results for client in result]
  if isinstance(value_type, tff.StructType):
    parts = [_elements(r) for r in results]
    return tff.structure.Struct([(name, _joined([p[i][1] for p in parts], t))
                                 for i, ((name, _), t) in enumerate(zip(parts[0], value_type))])
  return results[0]


def _has_client_values(value_type) -> bool:
  """Whether `value_type` holds a CLIENTS-placed value that differs between clients."""
  return _per_client(value_type) or (
      isinstance(value_type, tff.StructType) and any(_has_client_values(t) for t in value_type))


def _to_numpy(value):
  """`value` with its eager tensors and variables as NumPy arrays, as TFF's contexts send them (`tff.tensorflow`'s
  `transform_args`), inside `tff.structure.Struct`s too."""
  if isinstance(value, tff.structure.Struct):
    return tff.structure.Struct([(name, _to_numpy(v)) for name, v in tff.structure.iter_elements(value)])
  return tff.tensorflow.transform_args(value)


def _as_structs(value, value_type):
  """`value` with its structures as `tff.structure.Struct`s, as `type_to_py_container` takes them, except the values
  placed at CLIENTS, which stay lists (one element per client; SCAFFOLD's and personalized RFA's client state)."""
  if _per_client(value_type):
    return [_as_structs(v, value_type.member) for v in value]
  if isinstance(value_type, tff.FederatedType):
    return _as_structs(value, value_type.member)
  if not isinstance(value_type, tff.StructType):
    return value
  elements = _elements(value)
  return tff.structure.Struct([(name, _as_structs(v, t)) for (name, v), t in zip(elements, value_type)])


def _check_target(target: str) -> None:
  """Raises ValueError unless `target` is 'host:port' (IPv6 hosts in brackets) or 'unix:/absolute/path'."""
  if target.startswith('unix:'):
    if not target[len('unix:'):].lstrip('/'):
      raise ValueError(f'targets: {target!r} names no socket path')
    return
  host, _, port = target.rpartition(':')
  if not host or not port.isdigit():
    raise ValueError(f'targets: {target!r} is not host:port')


def _connect_probe(target: str, timeout: float) -> None:
  """A plain connection to `target` (no gRPC), so that nothing listening fails at once, naming the address."""
  try:
    if target.startswith('unix:'):
      path = target[len('unix:'):]
      if path.startswith('//'):
        path = path[2:]
      with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
    else:
      host, _, port = target.rpartition(':')
      socket.create_connection((host.strip('[]'), int(port)), timeout=timeout).close()
  except (OSError, ValueError) as e:
    reason = 'timed out' if isinstance(e, socket.timeout) else (getattr(e, 'strerror', None) or str(e))
    raise RuntimeError(
        f'no TFF worker answers at {target}: {reason} (start one there with `python -m tff_gma.worker`)') from e


def _compile_for_workers(comp):
  """The multi-worker context's compiler (TFF caches its result per computation)."""
  # A computation that aggregates in several sequential stages (multi-pass RFA) cannot take TFF's mergeable form:
  # refused here, where it is invoked, with the reason and the way out, not with TFF's "Detected one aggregate
  # dependent on another" and a dump of building blocks.
  check_single_aggregation_stage(comp)
  # Lower the secure intrinsics before splitting into mergeable form (as the per-worker compiler does): TFF's
  # mergeable compiler only recognises the plain aggregation intrinsics.
  return tff.backends.native.compile_to_mergeable_comp_form(
      tff.backends.test.replace_secure_intrinsics_with_bodies(comp))


def set_multi_worker_context(targets: Sequence[str], *, default_num_clients: int = 0,
                             connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
  """Distributes each computation's clients over the TFF workers at `targets` ('host:port', ...).

  TFF's own distributed runtime: TFF's remote executor on each worker and TFF's mergeable-computation form,
  which compiles a computation to `MergeableCompForm` (the work before the aggregation runs on every worker
  on its share of the clients, the partial aggregates are merged, the rest runs once). Limit of that form: one
  aggregation stage per computation, so a multi-pass aggregate runs in stages, one computation each
  (`GeometricMedianFactory.create_staged`); a computation of several stages is refused
  (`check_single_aggregation_stage` before training, and the context itself when it is invoked: a ValueError naming
  the number of stages). The workers are not owned here: start them with
  `start_local_workers` on this host (their `target`s are private Unix sockets, 'unix:/path'), or
  `python -m tff_gma.worker --port=P` (target 'host:P') or `--unix=PATH` (target 'unix:PATH'): on this host only
  their owner can connect to those; other hosts that reach a TCP one can, unauthenticated, by design: bind it to
  a private address and firewall its port (its start-up message says how).

  Each worker must answer within `connect_timeout_s`; otherwise a RuntimeError names its address (a refused
  connection fails at once).
  """
  if not targets:
    raise ValueError('targets must name at least one worker (host:port)')
  for target in targets:
    _check_target(target)
  for target in targets:
    _connect_probe(target, connect_timeout_s)
    channel = grpc.insecure_channel(target, worker_process.GRPC_OPTIONS)
    try:
      grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
    except grpc.FutureTimeoutError as e:
      raise RuntimeError(f'no TFF worker answers at {target} within {connect_timeout_s:g}s '
                         f'(something listens there, but no gRPC service answered)') from e
    finally:
      channel.close()
  # Installed as the simulation contexts are: TFF's own worker stopped first, the replaced context collected.
  contexts.install_default(create_context(targets, default_num_clients=default_num_clients))


def create_context(targets: Sequence[str], *, default_num_clients: int = 0) -> tff.framework.SyncContext:
  """The context `set_multi_worker_context` installs, over the workers at `targets`, not installed and without
  checking that they answer (for a caller that installs it for a block: `get_context_stack().install`)."""
  factories = [contexts.executor_factory(None, default_num_clients, target=target) for target in targets]
  return _MergeableContext(factories, _compile_for_workers, contexts.compile_for_simulation)


def start_local_workers(count: int, *, log_dir: Optional[str] = None) -> list[WorkerProcess]:
  """Starts `count` owned workers on this host (stopped at exit like the simulation context's worker).

  Each is confined like the simulation context's worker: pass their `target`s ('unix:/path' where confined,
  else '127.0.0.1:port') to `set_multi_worker_context`.
  """
  if count < 1:
    raise ValueError(f'count must be positive, got {count}')
  workers = []
  default_log = log_dir is None and os.environ.get('TFF_GMA_WORKER_LOG') is None
  for i in range(count):
    log = os.path.join(log_dir, f'worker_{i}.log') if log_dir else files.default_log_path()
    workers.append(WorkerProcess(log_path=log, remove_log_on_stop=default_log).start())
  worker_process.install_sigterm_handler()
  contexts.drop_unused_assertion_reports()
  return workers


def check_single_aggregation_stage(process) -> int:
  """Raises ValueError if `process.next` (or `process`, a computation) aggregates client data in more than one
  sequential stage.

  TFF's mergeable-computation context (several workers) supports a single stage; the count comes from the
  static audit of the computation (`tff_gma.audit`). Returns the number of stages.
  """
  from tff_gma import audit  # pylint: disable=g-import-not-at-top
  if hasattr(process, 'computations'):  # A round in stages (`tff_gma.learning.StagedLearningProcess`): each one.
    return max(check_single_aggregation_stage(comp) for _, comp in process.computations())
  passes = audit.audit_computation(process, policy=audit.AuditPolicy(allow_plain_sum=True)).aggregation_passes
  if passes > 1:
    subject = 'computation' if isinstance(process, tff.Computation) else 'process'
    raise ValueError(
        f'this {subject} aggregates in {passes} sequential client-to-server stages; TFF\'s multi-worker '
        f'(mergeable-computation) runtime runs one stage per computation: use one worker, or a one-stage '
        f'aggregator (mean, gma, rfa_one_step)')
  return passes

