"""Several TFF workers per round: TFF's mergeable-computation context over workers this process may not own.

Each round's clients are split over the workers at the given targets (one asynchronous context per worker, the
secure intrinsics lowered before the split). TFF's mergeable form runs one aggregation stage per computation,
so multi-pass aggregates are refused here, by name, before TFF would fail on them with a dump of its building
blocks. `start_local_workers` starts owned workers on this host for it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Optional

import grpc
import tensorflow_federated as tff

from tff_gma.runtime import contexts
from tff_gma.runtime import files
from tff_gma.runtime import worker_process
from tff_gma.runtime.worker_process import WorkerProcess

CONNECT_TIMEOUT_S = 10.0  # For workers this process does not own (`set_multi_worker_context`).


class _MergeableContext(tff.framework.MergeableCompExecutionContext):
  """TFF's mergeable context, returning results in the Python containers of the computation's result type.

  TFF's version converts results with the type of the compiled `after_merge` part, which has lost the
  containers (a learning process's `next` then returns an OrderedDict instead of a `LearningProcessOutput`).
  """

  def invoke(self, comp, arg=None):
    result = super().invoke(comp, arg)
    if isinstance(comp, tff.Computation) and isinstance(result, (tff.structure.Struct, list, tuple, dict)):
      result = tff.types.type_to_py_container(
          tff.structure.from_container(result, recursive=True), comp.type_signature.result)
    return result


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

  TFF's own distributed runtime: one asynchronous context per worker and TFF's mergeable-computation context,
  which compiles a computation to `MergeableCompForm` (the work before the aggregation runs on every worker
  on its share of the clients, the partial aggregates are merged, the rest runs once). Limit of that form: one
  aggregation stage per computation, so multi-pass aggregates (RFA with more than one pass) cannot run on it
  (`check_single_aggregation_stage` says so before training, and the context itself when such a computation is
  invoked: a ValueError naming the number of stages). The workers are not owned here: start them with
  `start_local_workers` on this host (their `target`s are private Unix sockets, 'unix:/path'), or
  `python -m tff_gma.worker --port=P` (target 'host:P') or `--unix=PATH` (target 'unix:PATH'): on this host only
  their owner can connect to those; other hosts that reach a TCP one can, unauthenticated, by design: see its
  start-up message and docs/runtime.md for how to restrict them.

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
  async_contexts = [
      tff.framework.AsyncExecutionContext(
          executor_fn=contexts.executor_factory(None, default_num_clients, target=target),
          compiler_fn=contexts.compile_for_simulation,
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
  static audit of the computation (`tff_gma.audit.static`). Returns the number of stages.
  """
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  passes = static.audit_computation(process, policy=static.AuditPolicy(allow_plain_sum=True)).aggregation_passes
  if passes > 1:
    subject = 'computation' if isinstance(process, tff.Computation) else 'process'
    raise ValueError(
        f'this {subject} aggregates in {passes} sequential client-to-server stages; TFF\'s multi-worker '
        f'(mergeable-computation) runtime runs one stage per computation: use one worker, or a one-stage '
        f'aggregator (mean, gma, rfa_one_step)')
  return passes

