"""The audit's two processes: a child imports the target and sends its computations as data; the parent checks them.

Importing `MODULE:ATTR` runs its code, which could forge a verdict reached or printed in that process; so the
parent never imports it, and reads the child's one message (serialized TFF protos) as data. The child is bounded in
time and memory and dies with the parent, and its output never reaches the parent's stdout.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

from tff_gma import confinement

# The message: magic, 8-byte big-endian length of the JSON body, the body.
MAGIC = b'tff-gma-audit-result/1\n'
_LENGTH = struct.Struct('>Q')
MAX_MESSAGE_BYTES = 1 << 30  # A learning process of a large model is tens of MB; more is no computation.
# What the child sends for each kind of target: the names its computations start with, in order; whether others
# follow (a process's other public computations, by name: `static.process_computations`); the main one.
KINDS = {
    'computation': (('computation',), False, 'computation'),
    'process': (('initialize', 'next'), True, 'next'),
    'factory': (('initialize', 'next'), True, 'next'),
    # A process in stages: `initialize`, then every computation it runs in their order (not by name); the main one
    # is the first after `initialize` (`STAGED_MAIN`).
    'staged': (('initialize',), True, None),
}
STAGED_MAIN = 1  # The index of a staged process's main computation.
MAX_COMPUTATIONS = 64  # Far more public computations than any process has.
_CLASS_NAME = re.compile(r'^[A-Za-z_][A-Za-z0-9_]*$')
_PUBLIC_NAME = re.compile(r'^[A-Za-z][A-Za-z0-9_]*$')
EXIT_INTERRUPTED = 130  # The child's status after a KeyboardInterrupt (128 + SIGINT, as a shell reports it).
OUTPUT_PREFIX = '[target] '
_POLL_S = 0.1
_PIPE_BYTES = 1 << 20  # Asked of each of the child's pipes (`F_SETPIPE_SZ`; Linux allows 1 MiB to any user).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A child killed by SIGKILL (not by the audit) that had used this share of its memory limit most likely met the
# system's out-of-memory killer: the kernel ends a process that way when the machine runs out before the limit.
_OOM_SHARE = 0.5
# What the parent's resident memory may grow by between its measure and the fork (Popen's own allocations).
_INHERITED_SLACK = 64 << 20
_running: set[int] = set()  # Children started and not reaped yet (their process group ids).
# The stop signals `stop_on_signals` got (the first ends the run), kept because the handler's own raise can be lost:
# run inside a garbage-collection callback (JAX registers one), it is printed as "Exception ignored" and the code
# goes on; caught where it lands, it can come out as another error. Its checkpoints (`raise_if_stopped`) and the end
# of `stop_on_signals` raise it again.
_stops: list[int] = []


class CommandError(ValueError):
  """A failure that is not a verdict; its message is the one line the command prints after `error: `."""


class TargetError(CommandError):
  """An error the child reported (the target could not be loaded, built or serialized): no verdict."""

  def __init__(self, message: str, traceback_text: Optional[str] = None):
    super().__init__(message)
    self.traceback_text = traceback_text


class Stopped(BaseException):  # pylint: disable=g-bad-exception-name
  """The parent got a signal that ends it (`stop_on_signals`): no verdict. A `BaseException`, as
  `KeyboardInterrupt` is: code this process runs meanwhile (TensorFlow's imports) must not swallow it."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def describe(error: BaseException) -> str:
  """`Type: message` of an exception (a syntax error with its full file path and line)."""
  if isinstance(error, SyntaxError):
    return f'{type(error).__name__}: {error.msg} ({error.filename}, line {error.lineno})'
  text = ' '.join(str(error).split())  # One line.
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def printable(text: str) -> str:
  """`text` with every character that is not printable (line breaks, terminal escapes) written as an escape."""
  if text.isprintable():
    return text
  return ''.join(c if c.isprintable() else c.encode('unicode_escape').decode('ascii') for c in text)


# ---------------------------------------------------------------------------------------------------------------
# The message.


def encode_message(body: dict[str, Any]) -> bytes:
  """The bytes the child writes: `MAGIC`, the body's length, the body as JSON."""
  data = json.dumps(body, separators=(',', ':')).encode('utf-8')
  return MAGIC + _LENGTH.pack(len(data)) + data


def result_body(kind: str, class_name: str, computations: Sequence[tuple[str, bytes]],
                value_type: Optional[bytes] = None, weight_type: Optional[bytes] = None) -> dict[str, Any]:
  """The body of a result: serialized `pb.Computation`s (and, for a factory, serialized `pb.Type`s)."""
  encode = lambda data: None if data is None else base64.b64encode(data).decode('ascii')
  return {'result': {'kind': kind, 'class': class_name, 'value_type': encode(value_type),
                     'weight_type': encode(weight_type), 'computations': [[n, encode(c)] for n, c in computations]}}


def error_body(message: str, traceback_text: Optional[str] = None) -> dict[str, Any]:
  return {'error': message, 'traceback': traceback_text}


class MalformedMessage(ValueError):
  """What the child sent is not a well-formed message (the text says what is wrong)."""


def computation_names_problem(kind: str, names: Sequence[Any]) -> Optional[str]:
  """Why `names` are not the computations a target of `kind` sends, in words; None when they are."""
  first, others_follow, _ = KINDS[kind]
  others = list(names[len(first):])
  expected = f'a {kind} sends the computations {list(first)}'
  if others_follow:
    expected += ' then its other public computations by name'
  if (tuple(names[:len(first)]) != first or (others and not others_follow) or len(names) > MAX_COMPUTATIONS
      or any(not isinstance(n, str) or not _PUBLIC_NAME.match(n) for n in others)
      or (others != sorted(set(others)) and kind != 'staged') or len(set(others)) != len(others)
      or set(others) & set(first) or (kind == 'staged' and not others)):
    return f'{expected}, each once, as [name, base64]'
  return None


@dataclasses.dataclass(frozen=True)
class Loaded:
  """A well-formed result, decoded by the parent: what the target is, and its building blocks.

  Attributes:
    description: the target's kind in words, as the report's subject shows it (`computation`, the process's class,
      `Factory.create(value_type[, weight_type])`), written by the parent from checked fields.
    computations: (name, building block) for each computation, in the order `KINDS` says.
    main: the computation whose passes the report counts.
  """

  description: str
  computations: tuple[tuple[str, Any], ...]
  main: str


def _field(mapping: Any, key: str, types: Any, where: str) -> Any:
  if not isinstance(mapping, dict) or key not in mapping:
    raise MalformedMessage(f'{where} has no {key!r}')
  value = mapping[key]
  if not isinstance(value, types):
    raise MalformedMessage(f'{where}[{key!r}] is a {type(value).__name__}')
  return value


def _base64(text: str, what: str) -> bytes:
  try:
    return base64.b64decode(text.encode('ascii'), validate=True)
  except (binascii.Error, UnicodeEncodeError) as e:
    raise MalformedMessage(f'{what} is not base64') from e


def decode_message(data: bytes) -> 'Loaded':
  """The child's message -> `Loaded`; `TargetError` for an error message; `MalformedMessage` for anything else.

  Checks the framing (magic, length, nothing after the body), the body's schema, that the names are the ones the
  kind has, and parses each proto with TFF's own deserializers (a parse that fails is malformed).
  """
  if not data.startswith(MAGIC):
    raise MalformedMessage(f'it does not start with the message header (got {data[:24]!r})')
  header_end = len(MAGIC) + _LENGTH.size
  if len(data) < header_end:
    raise MalformedMessage('it ends inside the header')
  (length,) = _LENGTH.unpack(data[len(MAGIC):header_end])
  if len(data) - header_end != length:
    raise MalformedMessage(f'the header announces {length} bytes and {len(data) - header_end} follow')
  try:
    body = json.loads(data[header_end:].decode('utf-8'))
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise MalformedMessage(f'the body is not JSON ({describe(e)})') from e
  if not isinstance(body, dict) or len(body) != (2 if 'error' in body else 1):
    raise MalformedMessage('the body is neither one result nor one error')
  if 'error' in body:
    message = _field(body, 'error', str, 'the error')
    traceback_text = _field(body, 'traceback', (str, type(None)), 'the error')
    raise TargetError(printable(' '.join(message.split())) or 'the target\'s process reported an error',
                      traceback_text)
  result = _field(body, 'result', dict, 'the body')
  expected = {'kind', 'class', 'value_type', 'weight_type', 'computations'}
  if set(result) != expected:
    raise MalformedMessage(f'the result has the fields {sorted(result)}, not {sorted(expected)}')
  kind = _field(result, 'kind', str, 'the result')
  if kind not in KINDS:
    raise MalformedMessage(f'unknown kind {printable(kind)!r}')
  class_name = _field(result, 'class', str, 'the result')
  if not _CLASS_NAME.match(class_name):
    raise MalformedMessage(f'the class name {printable(class_name)!r} is not an identifier')
  _, _, main = KINDS[kind]
  pairs = _field(result, 'computations', list, 'the result')
  problem = computation_names_problem(kind, [p[0] if isinstance(p, list) and p else None for p in pairs])
  if problem is None and any(not isinstance(p, list) or len(p) != 2 or not isinstance(p[1], str) for p in pairs):
    problem = computation_names_problem(kind, [])
  if problem is not None:
    raise MalformedMessage(problem)
  if main is None:
    main = pairs[STAGED_MAIN][0]
  value_type = _field(result, 'value_type', (str, type(None)), 'the result')
  weight_type = _field(result, 'weight_type', (str, type(None)), 'the result')
  if (value_type is not None) != (kind == 'factory') or (weight_type is not None and kind != 'factory'):
    raise MalformedMessage('value and weight types come with a factory, and a factory has a value type')

  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff
  from tensorflow_federated.proto.v0 import computation_pb2
  # pylint: enable=g-import-not-at-top

  def parse(what: str, text: str, message_type: Any) -> Any:
    try:
      return message_type.FromString(_base64(text, what))
    except MalformedMessage:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise MalformedMessage(f'{what} does not parse ({describe(e)})') from e

  computations = []
  for name, text in pairs:
    what = f'the computation {name!r}'
    proto = parse(what, text, computation_pb2.Computation)
    try:
      computations.append((name, tff.framework.ComputationBuildingBlock.from_proto(proto)))
    except Exception as e:  # pylint: disable=broad-except
      raise MalformedMessage(f'{what} does not parse ({describe(e)})') from e
  description = 'computation' if kind == 'computation' else class_name
  if kind == 'factory':
    types = []
    for what, text in (('the value type', value_type), ('the weight type', weight_type)):
      if text is not None:
        try:
          types.append(tff.types.deserialize_type(parse(what, text, computation_pb2.Type)))
        except MalformedMessage:
          raise
        except Exception as e:  # pylint: disable=broad-except
          raise MalformedMessage(f'{what} does not parse ({describe(e)})') from e
    description = f'{class_name}.create({", ".join(str(t) for t in types)})'
  return Loaded(description=description, computations=tuple(computations), main=main)


# ---------------------------------------------------------------------------------------------------------------
# The parent's side: run the child, relay its output, collect its message.


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
  """Within: SIGTERM, SIGINT and SIGHUP (those not ignored) kill the running child's process group and raise
  `Stopped` in the main thread (whose `finally` blocks then reap the child), rather than ending the process where
  it stands. Restores the previous handlers after."""
  _stops.clear()
  unraisable_hook = sys.unraisablehook

  def quiet_lost_stop(unraisable) -> None:  # A lost raise of ours is kept in `_stops`: no traceback for it.
    if not isinstance(unraisable.exc_value, Stopped):
      unraisable_hook(unraisable)

  def handler(signum, frame):
    del frame
    for pid in list(_running):  # At once, whatever raising does next.
      _kill_group(pid)
    if not _stops:  # The first signal ends the run; one more while it cleans up must not cut the cleanup short.
      _stops.append(signum)
      raise Stopped(signum)

  previous = {}
  for signum in _STOP_SIGNALS:
    if signal.getsignal(signum) is not signal.SIG_IGN:  # An ignored one stays ignored (`nohup`: SIGHUP).
      previous[signum] = signal.signal(signum, handler)
  sys.unraisablehook = quiet_lost_stop
  try:
    yield
    raise_if_stopped()  # A stop whose raise was lost after the last checkpoint: still no verdict.
  except BaseException as e:
    if _stops and not isinstance(e, Stopped):
      # The handler's raise became another error where it landed (code that catches it and raises its own: an
      # import half done leaves a module without its attributes): the run was stopped all the same.
      raise Stopped(_stops[0]) from e
    raise
  finally:
    for signum, old in previous.items():
      signal.signal(signum, old)
    sys.unraisablehook = unraisable_hook
    _stops.clear()


def raise_if_stopped() -> None:
  """Raises `Stopped` if `stop_on_signals` got a stop signal whose own raise was lost (see `_stops`)."""
  if _stops:
    raise Stopped(_stops[0])


def physical_memory_bytes() -> int:
  """This machine's memory: the child's default limit."""
  return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


def resident_bytes(pid: Any = 'self') -> int:
  """A process's resident memory now (0 when it cannot be read)."""
  try:
    with open(f'/proc/{pid}/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except (OSError, ValueError, IndexError):
    return 0


def own_peak_bytes(pid: int) -> int:
  """The peak resident memory of a live process's own image (`VmHWM`; 0 once it has ended or when unreadable).

  Unlike the `ru_maxrss` a reaper gets, it does not count what the process inherited from its parent at fork."""
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return 0


def gib(size: float) -> str:
  return f'{size / (1 << 30):.3g} GiB'


def _child_preexec(parent_pid: int, memory_limit: Optional[int]) -> Callable[[], None]:
  """Between fork and exec in the child: default dispositions for the signals a background job ignores (and
  would pass on), then `PR_SET_PDEATHSIG=SIGKILL` (exits at once if the parent is already gone), then the memory
  limit (`RLIMIT_AS`), so that a target that needs too much fails with a `MemoryError` the loader reports,
  rather than the kernel's out-of-memory killer ending the child (or another process) without a word."""
  die_with_parent = confinement.die_with_parent_of(parent_pid)

  def preexec() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # SIGINT and SIGQUIT: die_with_parent_of's.
    die_with_parent()
    if memory_limit is not None:
      _, hard = resource.getrlimit(resource.RLIMIT_AS)
      limit = memory_limit if hard == resource.RLIM_INFINITY else min(memory_limit, hard)
      resource.setrlimit(resource.RLIMIT_AS, (limit, hard))

  return preexec


class _Relay:
  """Copies the child's output to a file descriptor line by line, prefixed, control characters escaped."""

  def __init__(self, fd: int):
    self._fd = fd
    self._partial = b''

  def feed(self, data: bytes) -> None:
    lines = (self._partial + data).split(b'\n')
    self._partial = lines.pop()
    if len(self._partial) > 1 << 16:  # A line with no end: show it in pieces.
      lines.append(self._partial)
      self._partial = b''
    self._write(lines)

  def close(self) -> None:
    if self._partial:
      self._write([self._partial])
      self._partial = b''

  def _write(self, lines: list[bytes]) -> None:
    if not lines:
      return
    text = ''.join(OUTPUT_PREFIX + printable(line.decode('utf-8', 'backslashreplace').rstrip('\r')) + '\n'
                   for line in lines)
    try:
      os.write(self._fd, text.encode('utf-8'))
    except OSError:
      pass  # Our stderr is gone: the target's output is lost, the audit goes on.


def _exited(pid: int) -> bool:
  """Whether the child has ended, leaving it unreaped: while it is a zombie its process group id cannot be reused,
  so killing that group cannot hit another process group."""
  return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _how(code: int) -> str:
  """How the child ended, in words."""
  if code in (-signal.SIGINT, EXIT_INTERRUPTED):
    return 'interrupted (Ctrl-C)'
  if code < 0:
    try:
      return f'killed by signal {signal.Signals(-code).name}'
    except ValueError:
      return f'killed by signal {-code}'
  return f'exit status {code}'


@dataclasses.dataclass
class Child:
  """A started child: its process, the pipes it writes, and when it must be done."""

  process: subprocess.Popen
  result_fd: int
  output_fd: int
  deadline: float
  timeout_s: float
  memory_limit: Optional[int] = None
  # Linux's `ru_maxrss` of a forked child starts at its parent's resident memory at fork: the child's own peak is
  # known from it only above that (`inherited_rss`), else from `VmHWM` sampled while it runs (`sampled_peak`).
  inherited_rss: int = 0
  sampled_peak: int = 0
  peak_rss: int = 0  # Bytes, once reaped.


def start_child(argv: Sequence[str], timeout_s: float, env: Optional[dict[str, str]] = None,
                memory_limit: Optional[int] = None) -> Child:
  """Starts `python ARGV RESULT_FD` (the loader) as the audit's child.

  The child runs in its own process group, with stdin from /dev/null, SIGINT/SIGQUIT/SIGHUP at their defaults and
  `PR_SET_PDEATHSIG=SIGKILL`, its address space limited to `memory_limit` bytes when given; its stdout and stderr go
  to one pipe whose lines the parent copies to its own stderr prefixed `[target] `, control characters escaped. It is
  killed with its group past `timeout_s`, when the parent gets SIGTERM/SIGINT/SIGHUP (`stop_on_signals`), and, for
  what it left behind, as soon as it ends.

  Call before starting threads (it forks with a `preexec_fn`); `collect` then reads it to its end.
  """
  result_read, result_write = os.pipe()
  output_read, output_write = os.pipe()
  for fd in (result_write, output_write):  # Room for a learning process's protos while the parent imports TFF.
    with contextlib.suppress(OSError):
      fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
  try:
    process = subprocess.Popen(
        [sys.executable, *argv, str(result_write)], stdin=subprocess.DEVNULL, stdout=output_write,
        stderr=output_write, pass_fds=(result_write,), close_fds=True, process_group=0, env=env,
        preexec_fn=_child_preexec(os.getpid(), memory_limit))
  except BaseException:
    for fd in (result_read, output_read):
      os.close(fd)
    raise
  finally:
    os.close(result_write)
    os.close(output_write)
  _running.add(process.pid)
  return Child(process, result_read, output_read, time.monotonic() + timeout_s, timeout_s, memory_limit,
               inherited_rss=resident_bytes())


def _reap(child: Child) -> None:
  """Waits for the child and keeps its peak memory (which `Popen.wait` does not tell)."""
  process = child.process
  if process.returncode is not None:
    return
  _, status, usage = os.wait4(process.pid, 0)
  process.returncode = os.waitstatus_to_exitcode(status)
  reported = usage.ru_maxrss * 1024  # Linux counts it in KiB.
  own = reported if reported > child.inherited_rss + _INHERITED_SLACK else 0
  child.peak_rss = max(own, child.sampled_peak)


def _killed_for_memory(child: Child) -> bool:
  """Whether a child that SIGKILL ended, not sent by the audit, had used most of the memory it may use."""
  limit = child.memory_limit or physical_memory_bytes()
  return child.process.returncode == -signal.SIGKILL and child.peak_rss >= _OOM_SHARE * limit


def collect(child: Child, target: str, output_fd: int = 2, meanwhile: Optional[Callable[[], Any]] = None) -> bytes:
  """Reads the child's message until it ends; its bytes, or `CommandError` (one line) when there is none.

  `meanwhile` runs first, while the child works (the parent's own imports); the child's output waits in its pipe
  until then, while a timer thread kills the child at its deadline. The child's output is copied to `output_fd`
  as it comes. Whatever ends this (the child's end, the deadline, a `Stopped` raised by a signal, any error), the
  child's process group is killed and the child reaped before this returns or raises.
  """
  process = child.process
  relay = _Relay(output_fd)
  chunks, size = [], 0
  open_fds = [child.result_fd, child.output_fd]
  too_large = False
  expired = threading.Event()

  def expire() -> None:  # From a timer thread: on time even while `meanwhile` runs.
    if not _exited(process.pid):
      expired.set()
      _kill_group(process.pid)

  timer = threading.Timer(max(0.0, child.deadline - time.monotonic()), expire)
  timer.daemon = True
  timer.start()
  try:
    if meanwhile is not None:
      meanwhile()
    while not _exited(process.pid):
      child.sampled_peak = max(child.sampled_peak, own_peak_bytes(process.pid))
      ready, _, _ = select.select(open_fds, [], [], _POLL_S)
      for fd in ready:
        data = os.read(fd, 1 << 16)
        if not data:
          open_fds.remove(fd)
        elif fd == child.result_fd:
          chunks.append(data)
          size += len(data)
        else:
          relay.feed(data)
      if size > MAX_MESSAGE_BYTES:
        too_large = True
        break
  finally:
    timer.cancel()
    timer.join()  # Before the child is reaped: `expire` must not signal a process group id that is free again.
    _kill_group(process.pid)  # The child if it still runs, and whatever it left behind in its group.
    _reap(child)
    _running.discard(process.pid)
    for fd in open_fds:  # What the child wrote before it ended (bounded: a writer that escaped its group).
      os.set_blocking(fd, False)
      drained = 0
      with contextlib.suppress(BlockingIOError, OSError):
        while size <= MAX_MESSAGE_BYTES and drained <= 4 * _PIPE_BYTES and (data := os.read(fd, 1 << 16)):
          drained += len(data)
          if fd == child.result_fd:
            chunks.append(data)
            size += len(data)
          else:
            relay.feed(data)
    too_large = too_large or size > MAX_MESSAGE_BYTES
    relay.close()
    for fd in (child.result_fd, child.output_fd):
      os.close(fd)
  raise_if_stopped()  # The child died of the stop's SIGKILL: say the stop, not the death.
  if expired.is_set():
    raise CommandError(f'the audit of {target}: loading the target did not finish within '
                       f'--timeout={child.timeout_s:g} s; its process was killed; no verdict')
  if too_large:
    raise CommandError(f'the audit of {target}: the target\'s process sent more than {MAX_MESSAGE_BYTES} bytes; it '
                       'was killed; no verdict')
  code = process.returncode
  if not chunks and _killed_for_memory(child):
    raise CommandError(f'the audit of {target} ran out of memory: the target\'s process was killed by SIGKILL after '
                       f'using {gib(child.peak_rss)} '
                       f'(its limit: {gib(child.memory_limit or physical_memory_bytes())}), '
                       'most likely by the system\'s out-of-memory killer; no verdict')
  if code != 0 or not chunks:
    raise CommandError(f'the audit of {target} ended ({_how(code)}) before the target\'s process sent its result: '
                       'the audited code ended the process; no verdict')
  return b''.join(chunks)
