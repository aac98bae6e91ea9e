"""Several TFF workers per round: TFF's mergeable-computation context over workers this process may not own.

Each round's clients are split over the workers at the given targets (one asynchronous context per worker, the
secure intrinsics lowered before the split). TFF's mergeable form runs one aggregation stage per computation:
a multi-pass aggregate runs as one computation per pass (`GeometricMedianFactory.create_staged`), and a
computation of several stages is refused by name, before TFF would fail on it with a dump of its building
blocks. `start_local_workers` starts owned workers on this host for it.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Optional

import grpc
import tensorflow_federated as tff

from tff_gma import tff_internals
from tff_gma.runtime import contexts
from tff_gma.runtime import files
from tff_gma.runtime import worker_process
from tff_gma.runtime.worker_process import WorkerProcess

CONNECT_TIMEOUT_S = 10.0  # For workers this process does not own (`set_multi_worker_context`).


class _MergeableContext(tff.framework.SyncContext):
  """TFF's mergeable-computation context (the computation compiled to TFF's `MergeableCompForm`, run over the
  workers' async contexts), with each worker's results kept in the order of its clients.

  TFF's `MergeableCompExecutionContext` merges the workers' partial aggregates, and concatenates their
  CLIENTS-placed results (SCAFFOLD's and personalized RFA's client state), in the order the workers finish: a later
  worker finishing first gives its clients' results to the first worker's clients, and with three workers or more
  the merge order changes the sums' last bits from run to run. Not built on it (it would start an event loop and a
  compiler pipeline this never uses). Here the workers' slices run side by side, and their results are merged and
  joined in the slices' order. Results come back in the Python containers of the computation's result type (TFF's
  lose them: a learning process's `next` would return an OrderedDict instead of a `LearningProcessOutput`).

  Each worker's context runs on an event loop of its own, in a thread of its own: TFF's `RemoteExecutor` makes
  blocking gRPC calls inside its coroutines, so the workers' coroutines gathered on one loop would run one after
  the other (each worker's whole share, then the next's), never side by side.
  """

  def __init__(self, async_contexts, compiler_fn):
    self._workers = list(async_contexts)
    self._compile = compiler_fn
    self._forms = {}  # Each computation's mergeable form, compiled once.
    self._merged_afters = {}  # (form, partials) -> `_merge_then_after_merge` of it.
    self._runners = [tff_internals.async_thread_runner() for _ in self._workers]
    # The last invocation's wall seconds by stage (split, up_to_merge, merge_and_after_merge, result_containers,
    # invoke): what the benchmark's breakdown reads (`training.bench.multi_worker`).
    self.last_stages = {}

  def invoke(self, comp, arg=None):
    began = time.perf_counter()
    self.last_stages = {}
    form = comp
    if isinstance(comp, tff.Computation):
      if comp not in self._forms:
        self._forms[comp] = self._compile(comp)
      form = self._forms[comp]
    slices = [None] * len(self._workers)
    if arg is not None:
      slices = _split(arg, form.up_to_merge.type_signature.parameter, len(self._workers))
    self._stage('split', began)
    result = self._in_order(form, slices)
    converted = time.perf_counter()
    result_type = (comp if isinstance(comp, tff.Computation) else form.after_merge).type_signature.result
    result = tff.types.type_to_py_container(_as_structs(result, result_type), result_type)
    self._stage('result_containers', converted)
    self._stage('invoke', began)
    return result

  def _stage(self, name: str, began: float) -> None:
    self.last_stages[name] = self.last_stages.get(name, 0.0) + time.perf_counter() - began

  def _on(self, index: int, comp, arg):
    """`comp(arg)` on worker `index`, on that worker's event loop."""
    return self._runners[index].run_coro_and_return_result(self._workers[index].invoke(comp, arg))

  def _on_each(self, comp, args: list) -> list:
    """`comp` on worker i with `args[i]`, side by side; the results in the workers' order."""
    if len(args) == 1:
      return [self._on(0, comp, args[0])]
    # Daemon threads, not a ThreadPoolExecutor: its threads are joined at exit, so a call blocked on a stopped worker
    # would keep the process from exiting after the caller gave up on it (the runner's worker deadline).
    outcomes = [{} for _ in args]

    def call(i: int, arg) -> None:
      try:
        outcomes[i]['value'] = self._on(i, comp, arg)
      except BaseException as e:  # pylint: disable=broad-except
        outcomes[i]['error'] = e

    threads = [threading.Thread(target=call, args=(i, a), name=f'tff_gma_worker_call_{i}', daemon=True)
               for i, a in enumerate(args)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    for outcome in outcomes:
      if 'error' in outcome:
        raise outcome['error']
    return [outcome['value'] for outcome in outcomes]

  def _merged_after(self, form, parts: int):
    """`form`'s merge of `parts` partial aggregates, in their order, then its `after_merge`: one computation."""
    key = (form, parts)  # A form hashes by identity, and the key keeps it alive.
    if key not in self._merged_afters:
      self._merged_afters[key] = _merge_then_after_merge(form, parts)
    return self._merged_afters[key]

  def _in_order(self, form, slices):
    """`form` on the argument's slices, one a worker, merged and joined in the slices' order."""
    began = time.perf_counter()
    partials = self._on_each(form.up_to_merge, slices)
    self._stage('up_to_merge', began)
    began = time.perf_counter()
    # The merges run in the worker that runs `after_merge`, in the same computation: no round trip per merge, and
    # the merged aggregate never crosses to this process.
    if len(partials) == 1:
      after = form.after_merge
      args = lambda s: partials[0] if s is None else tff.structure.Struct.unnamed(s, partials[0])
    else:
      after = self._merged_after(form, len(partials))
      args = lambda s: tff.structure.Struct.unnamed(*([] if s is None else [s]), *partials)
    result_type = form.after_merge.type_signature.result
    if not _has_client_values(result_type):
      # Nothing placed at the clients comes back, so the clients' part of the argument cannot reach the result
      # (only an aggregation takes a value from the clients, and every aggregation ran before the merge): worker
      # 0 gets none of it, rather than its clients' data sent and built again.
      first = slices[0] if _has_placement(result_type, tff.CLIENTS) else _without_clients(
          slices[0], form.up_to_merge.type_signature.parameter)
      result = self._on(0, after, args(first))
    else:
      result = _joined(self._on_each(after, [args(s) for s in slices]), result_type)
    self._stage('merge_and_after_merge', began)
    return result


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


def _without_clients(value, value_type):
  """`value` with each CLIENTS-placed value that differs between clients cut to no clients (None stays None)."""
  return None if value is None else _sliced(value, value_type, 0, 0)


def _has_placement(value_type, placement) -> bool:
  """Whether `value_type` holds a value placed at `placement` (all-equal or not)."""
  if isinstance(value_type, tff.FederatedType):
    return value_type.placement is placement
  return isinstance(value_type, tff.StructType) and any(_has_placement(t, placement) for t in value_type)


def _has_client_values(value_type) -> bool:
  """Whether `value_type` holds a CLIENTS-placed value that differs between clients."""
  return _per_client(value_type) or (
      isinstance(value_type, tff.StructType) and any(_has_client_values(t) for t in value_type))


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


class _SharedCompiler:
  """One compilation of each computation for all the workers' contexts. Each context compiles what it is given
  (its own TFF `CompilerPipeline`, which caches per context), so N workers would compile every new computation N
  times, side by side under one interpreter lock: the driver's largest cost in a round's first call. The lock
  makes a second worker wait for the first one's compilation and take it from the cache."""

  def __init__(self, compiler_fn):
    self._cached = functools.lru_cache(maxsize=128)(compiler_fn)  # TFF's pipeline caches as many.
    self._lock = threading.Lock()

  def __call__(self, comp):
    with self._lock:
      return self._cached(comp)


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

  TFF's own distributed runtime: one asynchronous context per worker and TFF's mergeable-computation context,
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
  compiler = _SharedCompiler(contexts.compile_for_simulation)
  async_contexts = [
      tff.framework.AsyncExecutionContext(
          executor_fn=contexts.executor_factory(None, default_num_clients, target=target),
          compiler_fn=compiler,
          transform_args=tff.tensorflow.transform_args,
          transform_result=tff.tensorflow.transform_result,
      ) for target in targets
  ]
  # Installed as the simulation contexts are: TFF's own worker stopped first, the replaced context collected.
  contexts.install_default(_MergeableContext(async_contexts=async_contexts, compiler_fn=_compile_for_workers))


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

