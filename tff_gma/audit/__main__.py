"""Command line: audit a TFF computation, process or factory and print the report.

`python -m tff_gma.audit MODULE:ATTR [--value_type float32[10]] [...]` exits 0 (PASS), 1 (violations) or 3 (cannot
be decided), verdicts this process reaches itself and prints with the report, or 2 (no verdict: any error, in one
`error: ...` line). It never imports the target: a child process (`loader`) sends back the computations as data
(`isolation` says why); `--help` lists the arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import stat
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Optional

from tff_gma.audit import isolation
from tff_gma.audit import loader
from tff_gma.audit import policy as policy_lib
from tff_gma.audit.isolation import CommandError
# Re-exported (`name as name`): they were this module's before the loader took them, and are still reached
# through it (tests/tff_gma/audit/main_test.py calls parse_type as `__main__.parse_type`).
from tff_gma.audit.loader import load_attribute as load_attribute
from tff_gma.audit.loader import parse_type as parse_type

EXIT_OK = 0  # Verdict: PASS.
EXIT_VIOLATIONS = 1  # Verdict: FAIL.
EXIT_ERROR = 2  # No verdict: anything else went wrong.
EXIT_USAGE = EXIT_ERROR  # The former name.
EXIT_UNDECIDED = 3  # Verdict: UNDECIDED (no violation found, but places the audit cannot see through).
_EXIT_OF_VERDICT = {'PASS': EXIT_OK, 'FAIL': EXIT_VIOLATIONS, 'UNDECIDED': EXIT_UNDECIDED}
DEFAULT_TIMEOUT_S = 300.0
_LOADER = ('-m', 'tff_gma.audit.loader')


class _Parser(argparse.ArgumentParser):
  """argparse, with a bad argument said in one `error: ...` line (exit 2) rather than the usage block first."""

  def error(self, message: str):
    self.exit(EXIT_ERROR, f'error: {message} (python -m tff_gma.audit -h lists the options)\n')


def _positive(text: str, unit: str) -> float:
  """A positive finite number of `unit`s, or the argparse error that names the unit."""
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not math.isfinite(value) or value <= 0:
    raise argparse.ArgumentTypeError(f'expected a positive number of {unit}, got {text!r}')
  return value


def _seconds(text: str) -> float:
  return _positive(text, 'seconds')


def _gib(text: str) -> int:
  """`--memory_limit`: GiB -> bytes."""
  return int(_positive(text, 'GiB') * (1 << 30))


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog='python -m tff_gma.audit',
      description='Static audit of which intrinsics carry client data to the server in a TFF computation, and in '
      'how many sequential passes. A PASS does not mean that an aggregate reveals little about one client: see the '
      'Scope paragraph of the report. The target is imported in a child process, which sends back its '
      'computations; this process analyses them and gives the verdict.',
      epilog='exit status: 0 PASS, 1 FAIL (violations; also when places cannot be decided besides), 3 UNDECIDED '
      '(cannot be decided: no violation found, but the audit met places it cannot see through, e.g. a call of a '
      'functional parameter from CLIENTS to SERVER, an intrinsic it does not know; never a PASS), 2 error (no '
      'verdict: bad arguments, a target that cannot be loaded or audited, a target process that ends without '
      'sending its computations or runs out of memory, an audit that runs past --timeout, an unwritable '
      '--output). Every public computation of a process is audited (initialize, next, next_with_client_state, '
      '...).')
  parser.add_argument('target', help='MODULE:ATTR of a computation, process, factory, or a builder of one')
  parser.add_argument('--value_type', help='value type for a factory, e.g. float32[10]')
  parser.add_argument('--weight_type', help='weight type for a weighted factory (default float32)')
  parser.add_argument('--policy', choices=('default', 'allow-plain-sum'), default='default',
                      help='default: means and secure sums only; allow-plain-sum: also federated_sum')
  parser.add_argument('--allow', action='append', default=[], metavar='URI',
                      help='also allow this intrinsic (repeatable), e.g. federated_max')
  parser.add_argument('--format', choices=('markdown', 'json'), default='markdown')
  parser.add_argument('--output', help='also write the report to this file (not through a symbolic link; '
                      'written to a new file beside it, then renamed over it)')
  parser.add_argument('--timeout', type=_seconds, default=DEFAULT_TIMEOUT_S, metavar='SECONDS',
                      help='give up (exit 2) if loading the target in its process and analysing its computations '
                      f'take longer together (default {DEFAULT_TIMEOUT_S:g})')
  parser.add_argument('--memory_limit', type=_gib, default=None, metavar='GIB',
                      help='the address space the target\'s process may use, in GiB (default: this machine\'s '
                      'memory); past it, exit 2 saying the audit ran out of memory')
  parser.add_argument('--traceback', action='store_true', help='on an error, also print the Python traceback')
  return parser


# ---------------------------------------------------------------------------------------------------------------
# --output.


def _link_problem(path: str) -> Optional[str]:
  """Why `path` itself may not be written (a link, a directory, not a regular file); None if absent or a file."""
  try:
    info = os.lstat(path)
  except OSError:  # Absent, or under a file: `_check_output` says which.
    return None
  if stat.S_ISLNK(info.st_mode):
    try:
      where = f' (to {isolation.printable(os.readlink(path))})'
    except OSError:
      where = ''
    return f'is a symbolic link{where}; the audit does not write through one'
  if stat.S_ISDIR(info.st_mode):
    return 'is a directory'
  if not stat.S_ISREG(info.st_mode):
    return 'is not a regular file'
  return None


def _check_output(path: Optional[str]) -> None:
  """Fails before the audit when `--output` cannot be a file to write."""
  if path is None:
    return
  if not path:
    raise CommandError('--output: empty path')
  problem = _link_problem(path)
  if problem:
    raise CommandError(f'--output {path}: {problem}')
  directory = os.path.dirname(path) or '.'
  if not os.path.isdir(directory):
    problem = 'is a file, not a directory' if os.path.exists(directory) else 'does not exist'
    raise CommandError(f'--output {path}: directory {directory} {problem}')
  try:
    read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)  # Which even root cannot write.
  except OSError:
    read_only = False
  if read_only:
    raise CommandError(f'--output {path}: directory {directory} is on a read-only file system')
  if not os.access(directory, os.W_OK | os.X_OK):
    raise CommandError(f'--output {path}: directory {directory} is not writable by this user')


def _write_output(path: str, text: str) -> None:
  """Writes `text` to `path` atomically, never through a link: a new file (O_EXCL | O_NOFOLLOW) beside it, then
  renamed over it. A rename replaces a link planted after the check, it does not follow it."""
  problem = _link_problem(path)  # Again: the audit took a while.
  if problem:
    raise CommandError(f'--output {path}: {problem}')
  directory, name = os.path.split(path)
  tmp = os.path.join(directory, f'.{name}.{secrets.token_hex(6)}.tmp')
  try:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
  except OSError as e:
    raise CommandError(f'--output {path}: {e.strerror or isolation.describe(e)}') from e
  try:
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    if isinstance(e, OSError):
      raise CommandError(f'--output {path}: {e.strerror or isolation.describe(e)}') from e
    raise


# ---------------------------------------------------------------------------------------------------------------
# The parent's analysis of what the child sent.


def _import_static(release_context: bool = False):
  """Imports the analysis (TensorFlow Federated: seconds). `release_context` (the command): also releases the
  execution context TFF installs at import, which would start TFF's worker lazily; nothing is executed here."""
  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff
  from tff_gma.audit import static
  # pylint: enable=g-import-not-at-top
  if release_context:
    tff.test.set_no_default_context()
  if sys.getrecursionlimit() < static._MIN_RECURSION_LIMIT:  # pylint: disable=protected-access
    sys.setrecursionlimit(static._MIN_RECURSION_LIMIT)  # pylint: disable=protected-access
  return static


def _check_report(report, markdown: str, target: str) -> None:
  """Refuses a report in which text from the computation (names in types and paths, intrinsic URIs) could pass
  for the report's own: a line break or terminal escape in it, or a second `Verdict`."""
  from_target = [report.subject] + [c.type_signature for c in report.computations] + [
      text for f in report.flows for text in (f.intrinsic, f.value_type, f.where)] + [
          text for u in report.undecided for text in (u.where, u.reason)]
  bad = next((text for text in from_target if not text.isprintable()), None)
  if bad is None:  # Belt and braces: the whole report, line by line.
    bad = next((line for line in markdown.split('\n') if not line.isprintable()), None)
  if bad is not None:
    raise CommandError(f'the audit of {target}: the computation\'s names hold line breaks or control characters, '
                       f'which could pass for the report\'s own lines ({isolation.printable(bad)[:100]}); no verdict')
  if markdown.count('Verdict') != 1:
    raise CommandError(f'the audit of {target}: a name in the computation imitates the report\'s verdict line; no '
                       'verdict')


def _analysis_timeout(args: argparse.Namespace) -> CommandError:
  return CommandError(f'the audit of {args.target}: the analysis of the target\'s computations did not finish within '
                      f'--timeout={args.timeout:g} s (loading and analysis together); no verdict')


def _finish(data: bytes, args: argparse.Namespace, deadline: float) -> int:
  """Decodes the child's message, analyses it by `deadline` (`time.monotonic()`), writes and prints the report;
  the verdict's exit status."""
  static = _import_static()
  from tff_gma.audit import walker  # pylint: disable=g-import-not-at-top  # Imported by `static`.
  try:
    loaded = isolation.decode_message(data)
  except isolation.MalformedMessage as e:
    raise CommandError(f'the audit of {args.target}: the target\'s process sent a malformed result ({e}); no '
                       'verdict') from e
  policy = policy_lib.AuditPolicy(
      allowed_intrinsics=policy_lib.DEFAULT_ALLOWED_INTRINSICS | frozenset(args.allow),
      allow_plain_sum=args.policy == 'allow-plain-sum')
  try:
    audits = tuple(static._audit_building_block(name, block, policy, deadline)  # pylint: disable=protected-access
                   for name, block in loaded.computations)
    report = static.AuditReport(subject=f'{args.target} ({loaded.description})', policy=policy,
                                computations=audits, main=loaded.main)
    markdown = report.to_markdown()
    text = markdown if args.format == 'markdown' else report.to_json()
  except walker.AnalysisTimeout as e:
    raise _analysis_timeout(args) from e
  except Exception as e:  # pylint: disable=broad-except
    raise CommandError(f'cannot audit {args.target}: {isolation.describe(e)}') from e
  _check_report(report, markdown, args.target)
  isolation.raise_if_stopped()  # Nothing written or printed after a stop signal.
  if args.output is not None:
    _write_output(args.output, text + '\n')
  print(text, flush=True)
  return _EXIT_OF_VERDICT[report.verdict]


def _check_type_specs(args: argparse.Namespace) -> None:
  """A plain `DTYPE[...]` spec is checked here (NumPy only), before any child; `MODULE:ATTR` is the child's."""
  for option, spec in (('--value_type', args.value_type), ('--weight_type', args.weight_type)):
    if spec is not None and ':' not in spec:
      try:
        loader.parse_tensor_spec(spec)
      except ValueError as e:
        raise CommandError(f'{option} {spec!r}: {e}') from e


def _error_exit(error: BaseException, args: argparse.Namespace) -> int:
  """Prints the one `error: ...` line (after the traceback with --traceback) and returns EXIT_ERROR."""
  if isinstance(error, isolation.Stopped):
    message = (f'the audit of {args.target} was stopped by {signal.Signals(error.signum).name}; the target\'s '
               'process is gone; no verdict')
  elif isinstance(error, CommandError):
    message = str(error)
  elif isinstance(error, SystemExit):  # Not argparse's (parsing is done): code the audit ran called sys.exit.
    message = f'{args.target}: sys.exit({error.code!r}) called while loading or auditing it'
  else:
    message = f'internal error while auditing {args.target}: {isolation.describe(error)}'
  if args.traceback:
    child_traceback = getattr(error, 'traceback_text', None)
    if child_traceback:  # The child's, as data: each line escaped.
      lines = child_traceback.rstrip('\n').split('\n')
      print('\n'.join(isolation.printable(line) for line in lines), file=sys.stderr)
    else:
      traceback.print_exception(error, file=sys.stderr)
  print(f'error: {message}', file=sys.stderr, flush=True)
  return EXIT_ERROR


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command: the target loaded in a child process, the verdict reached here. Returns the exit status
  (argparse exits with 2 itself on bad arguments, and prints -h)."""
  args = _parser().parse_args(argv)
  try:
    with isolation.stop_on_signals():
      _check_output(args.output)
      _check_type_specs(args)
      request = json.dumps({'target': args.target, 'value_type': args.value_type, 'weight_type': args.weight_type,
                            'traceback': args.traceback})
      memory_limit = args.memory_limit or isolation.physical_memory_bytes()
      child = isolation.start_child([*_LOADER, request], args.timeout, memory_limit=memory_limit)
      # The analysis is imported while the child loads the target: both take seconds.
      data = isolation.collect(child, args.target, meanwhile=lambda: _import_static(release_context=True))
      return _finish(data, args, child.deadline)
  except (Exception, isolation.Stopped) as e:  # pylint: disable=broad-except
    return _error_exit(e, args)


def run_in_process(argv: Optional[Sequence[str]] = None) -> int:
  """`main` without the child: imports the target in this process, then the same decoding, analysis and output.

  For tests and trusted callers only: code the target runs here can forge anything this process prints.
  """
  args = _parser().parse_args(argv)
  deadline = time.monotonic() + args.timeout
  try:
    _check_output(args.output)
    _check_type_specs(args)
    data = loader.load_message(args.target, args.value_type, args.weight_type, args.traceback)
    return _finish(data, args, deadline)
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    return _error_exit(e, args)


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  sys.exit(main())
