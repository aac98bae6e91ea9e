"""Command line: audit a TFF computation, process or factory and print the report.

  python -m tff_gma.audit MODULE:ATTR [--value_type float32[10]] [--weight_type float32]
                                      [--policy default|allow-plain-sum] [--allow URI]... [--format markdown|json]
                                      [--output PATH] [--traceback]

`MODULE:ATTR` names a `tff.Computation`, an `AggregationProcess` / `LearningProcess` (or other
`IterativeProcess`), an aggregation factory (give `--value_type`), or a zero-argument callable returning one of
these. A type is `DTYPE` or `DTYPE[D1,D2,...]` (a `?` dimension is unknown), or `MODULE:ATTR` naming a `tff.Type`.

Exit status: 0 when the policy is met (PASS), 1 when there are violations (FAIL): these two are verdicts, and the
report is printed (and written to `--output`). 2 for everything else, with no verdict and no report: bad arguments,
a target module that cannot be imported (import error, syntax error, an exception or `sys.exit` at import), a
missing attribute, a builder that raises, a target the audit cannot read, an `--output` that cannot be written
(a directory, a missing directory, a path under a file, a read-only file system or a directory this user may not
write: checked before the audit), or an exception inside the audit. Each prints one `error: ...` line on stderr
(`--traceback` adds the Python traceback). A PASS establishes what the report's Scope paragraph says, no more
(`tff_gma.audit.static.AUDIT_SCOPE`). The audit is static: the command installs no execution context and starts
no TFF worker. The target is imported and audited in a child process, and a verdict counts only once its report
was printed: audited code that ends the process (`os._exit` at import, a signal, Ctrl-C) is exit 2 with one line
saying how it ended, never a PASS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any, Optional

_TENSOR_TYPE = re.compile(r'^\s*(?P<dtype>[A-Za-z][A-Za-z0-9_]*)\s*(?:\[(?P<dims>[^\]]*)\])?\s*$')
EXIT_OK = 0  # Verdict: PASS.
EXIT_VIOLATIONS = 1  # Verdict: FAIL.
EXIT_ERROR = 2  # No verdict: anything else went wrong.
EXIT_USAGE = EXIT_ERROR  # The former name.
_SUPPORTED = ('a tff.Computation, a tff.templates.IterativeProcess (e.g. an AggregationProcess or LearningProcess), '
              'an aggregation factory, or a zero-argument callable returning one')


class CommandError(ValueError):
  """A failure that is not a verdict; its message is the one line the command prints after `error: `."""


def _describe(error: BaseException) -> str:
  """`Type: message` of an exception (a syntax error with its full file path and line)."""
  if isinstance(error, SyntaxError):
    return f'{type(error).__name__}: {error.msg} ({error.filename}, line {error.lineno})'
  text = ' '.join(str(error).split())  # One line.
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def load_attribute(spec: str, role: str = 'target') -> Any:
  """`'package.module:name.attr'` -> that object; `CommandError` naming the problem when it cannot be loaded."""
  module_name, sep, attr_path = spec.partition(':')
  if not sep or not module_name or not attr_path:
    raise CommandError(f'{role} {spec!r}: expected MODULE:ATTR')
  try:
    value = importlib.import_module(module_name)
  except SystemExit as e:
    raise CommandError(f'cannot import module {module_name!r} of {role} {spec}: it called sys.exit({e.code!r}) '
                       'while being imported') from e
  except Exception as e:  # pylint: disable=broad-except
    raise CommandError(f'cannot import module {module_name!r} of {role} {spec}: {_describe(e)}') from e
  parts = attr_path.split('.')
  for i, part in enumerate(parts):
    try:
      value = getattr(value, part)
    except AttributeError as e:
      raise CommandError(f'{role} {spec}: module {module_name!r} has no attribute {".".join(parts[:i + 1])!r}') from e
    except Exception as e:  # pylint: disable=broad-except
      raise CommandError(f'{role} {spec}: reading {".".join(parts[:i + 1])!r} raised {_describe(e)}') from e
  return value


def parse_type(spec: Optional[str]):
  """A CLI type spec -> `tff.Type` (`None` stays `None`)."""
  if spec is None:
    return None
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  if ':' in spec:
    return tff.to_type(load_attribute(spec, role='type'))
  match = _TENSOR_TYPE.match(spec)
  if match is None:
    raise ValueError(f'cannot parse type {spec!r}; expected DTYPE, DTYPE[D1,...] or MODULE:ATTR')
  try:
    dtype = np.dtype(match['dtype'])
  except TypeError as e:
    raise ValueError(f'unknown dtype {match["dtype"]!r} in type {spec!r}') from e
  if match['dims'] is None:
    return tff.TensorType(dtype)
  dims = []
  for dim in (d.strip() for d in match['dims'].split(',') if d.strip()):
    if dim in ('?', 'None'):
      dims.append(None)
    elif dim.isdigit():
      dims.append(int(dim))
    else:
      raise ValueError(f'bad dimension {dim!r} in type {spec!r}')
  return tff.TensorType(dtype, dims)


def _resolve_subject(value: Any, spec: str) -> Any:
  """The auditable object a target names: itself, or what calling it (a builder) returns."""
  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff
  from tensorflow_federated.python.core.impl.compiler import building_blocks
  from tensorflow_federated.python.core.impl.computation import polymorphic_computation
  # pylint: enable=g-import-not-at-top
  supported = (tff.Computation, tff.templates.IterativeProcess, tff.aggregators.UnweightedAggregationFactory,
               tff.aggregators.WeightedAggregationFactory, building_blocks.ComputationBuildingBlock)
  described = f'target {spec} is {type(value).__name__}'
  if isinstance(value, polymorphic_computation.PolymorphicComputation):
    raise CommandError(f'target {spec} is a polymorphic computation (no parameter type yet): decorate it with '
                       'its parameter types, or name a builder that returns a typed computation')
  if not isinstance(value, supported) and callable(value):
    try:
      value = value()  # A builder: lets a module define expensive targets lazily.
    except SystemExit as e:
      raise CommandError(f'target {spec}: the builder called sys.exit({e.code!r})') from e
    except Exception as e:  # pylint: disable=broad-except
      raise CommandError(f'target {spec}: calling the builder raised {_describe(e)}') from e
    described = f'target {spec}() returned {type(value).__name__}'
  if not isinstance(value, supported):
    raise CommandError(f'{described}, which the audit cannot read: expected {_SUPPORTED}')
  return value


def _check_output(path: Optional[str]) -> None:
  """Fails before the audit when `--output` cannot be a file to write."""
  if path is None:
    return
  if not path:
    raise CommandError('--output: empty path')
  if os.path.isdir(path):
    raise CommandError(f'--output {path}: is a directory')
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


class _Parser(argparse.ArgumentParser):
  """argparse, with a bad argument said in one `error: ...` line (exit 2) rather than the usage block first."""

  def error(self, message: str):
    self.exit(EXIT_ERROR, f'error: {message} (python -m tff_gma.audit -h lists the options)\n')


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog='python -m tff_gma.audit',
      description='Static audit of which intrinsics carry client data to the server in a TFF computation, and in '
      'how many sequential passes. A PASS does not mean that an aggregate reveals little about one client: see the '
      'Scope paragraph of the report.',
      epilog='exit status: 0 PASS, 1 FAIL (violations), 2 error (no verdict: bad arguments, a target that cannot '
      'be loaded or audited, an unwritable --output).')
  parser.add_argument('target', help='MODULE:ATTR of a computation, process, factory, or a builder of one')
  parser.add_argument('--value_type', help='value type for a factory, e.g. float32[10]')
  parser.add_argument('--weight_type', help='weight type for a weighted factory (default float32)')
  parser.add_argument('--policy', choices=('default', 'allow-plain-sum'), default='default',
                      help='default: means and secure sums only; allow-plain-sum: also federated_sum')
  parser.add_argument('--allow', action='append', default=[], metavar='URI',
                      help='also allow this intrinsic (repeatable), e.g. federated_max')
  parser.add_argument('--format', choices=('markdown', 'json'), default='markdown')
  parser.add_argument('--output', help='also write the report to this file')
  parser.add_argument('--traceback', action='store_true', help='on an error, also print the Python traceback')
  return parser


def _parse_type_option(option: str, spec: Optional[str]):
  try:
    return parse_type(spec)
  except Exception as e:  # pylint: disable=broad-except
    raise CommandError(f'{option} {spec!r}: {e if isinstance(e, ValueError) else _describe(e)}') from e


def _audit(args: argparse.Namespace) -> int:
  _check_output(args.output)
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  value_type = _parse_type_option('--value_type', args.value_type)
  weight_type = _parse_type_option('--weight_type', args.weight_type)
  subject = _resolve_subject(load_attribute(args.target), args.target)
  policy = static.AuditPolicy(
      allowed_intrinsics=static.DEFAULT_ALLOWED_INTRINSICS | frozenset(args.allow),
      allow_plain_sum=args.policy == 'allow-plain-sum')
  try:
    report = static.audit_computation(subject, policy=policy, value_type=value_type, weight_type=weight_type,
                                      name=args.target)
    text = report.to_markdown() if args.format == 'markdown' else report.to_json()
  except Exception as e:  # pylint: disable=broad-except
    raise CommandError(f'cannot audit {args.target}: {_describe(e)}') from e
  if args.output is not None:
    try:
      with open(args.output, 'w') as f:
        f.write(text + '\n')
    except OSError as e:
      raise CommandError(f'--output {args.output}: {e.strerror or _describe(e)}') from e
  print(text)
  return EXIT_OK if report.ok else EXIT_VIOLATIONS


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the command; returns its exit status (argparse exits with 2 itself on bad arguments)."""
  args = _parser().parse_args(argv)
  try:
    return _audit(args)
  except (CommandError, SystemExit, Exception) as e:  # pylint: disable=broad-except
    if isinstance(e, CommandError):
      message = str(e)
    elif isinstance(e, SystemExit):  # Not argparse's (parsing is done): code the target runs called sys.exit.
      message = f'{args.target}: sys.exit({e.code!r}) called while loading or auditing it'
    else:
      message = f'internal error while auditing {args.target}: {_describe(e)}'
    if args.traceback:
      traceback.print_exc()
    print(f'error: {message}', file=sys.stderr)
    return EXIT_ERROR


# The audited code runs in a child process (this program again, with `_CHILD_ENV` naming the write end of a pipe):
# code that ends the process (`os._exit(0)` at import, a signal, Ctrl-C) must not read as a verdict. The child
# writes its verdict to the pipe after it printed the report; the parent returns the child's status only with that
# verdict, and otherwise says in one line that the audit ended without a report (exit 2).
_CHILD_ENV = 'TFF_GMA_AUDIT_VERDICT_FD'
_EXIT_INTERRUPTED = 130  # The child's status after a KeyboardInterrupt (128 + SIGINT, as a shell reports it).


def _supervise(argv: Sequence[str]) -> int:
  """Runs the audit in a child process; its exit status, or EXIT_ERROR when it ended without a verdict."""
  import signal  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  read_fd, write_fd = os.pipe()
  env = dict(os.environ, **{_CHILD_ENV: str(write_fd)})
  try:
    child = subprocess.Popen([sys.executable, '-m', 'tff_gma.audit', *argv], env=env, pass_fds=(write_fd,))
  finally:
    os.close(write_fd)
  interrupted = False
  while True:
    try:
      child.wait()
      break
    except KeyboardInterrupt:  # Ctrl-C reached the child too; wait for it to end, then say so.
      interrupted = True
      signal.signal(signal.SIGINT, signal.SIG_IGN)
  with os.fdopen(read_fd, 'rb') as pipe:
    verdict = pipe.read().decode('ascii', 'replace').strip()
  code = child.returncode
  if verdict in (str(EXIT_OK), str(EXIT_VIOLATIONS)) and code == int(verdict):
    return code
  if verdict == str(EXIT_ERROR) and code == EXIT_ERROR:
    return EXIT_ERROR  # The child printed its `error: ...` line.
  how = ('interrupted (Ctrl-C)' if interrupted or code in (-signal.SIGINT, _EXIT_INTERRUPTED)
         else f'killed by signal {signal.Signals(-code).name}' if code < 0 else f'exit status {code}')
  target = next((a for a in argv if not a.startswith('-')), 'the target')
  print(f'error: the audit of {target} ended ({how}) before printing its report: the audited code ended the '
        f'process; no verdict', file=sys.stderr, flush=True)
  return EXIT_ERROR


def run_program() -> int:
  """Entry point of `python -m tff_gma.audit`: the audit in a supervised child process (see `_supervise`), which
  runs `main` with no execution context installed."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.context_stack import set_default_context
  # pylint: enable=g-import-not-at-top
  # Auditing executes nothing: with no default context nothing can start TFF's worker, and the context TFF installed
  # at import (which would start one lazily) is released now rather than during interpreter shutdown.
  set_default_context.set_no_default_context()
  if _CHILD_ENV not in os.environ:
    # Here, not in the child: -h prints the help, and a bad argument is its one line (exit 2), not an audit
    # that "ended before printing its report".
    _parser().parse_args(sys.argv[1:])
    return _supervise(sys.argv[1:])
  verdict_fd = int(os.environ.pop(_CHILD_ENV))
  try:
    code = main()
  except KeyboardInterrupt:  # Ctrl-C (or code that raised it): no verdict; the parent says so in one line.
    return _EXIT_INTERRUPTED
  sys.stdout.flush()
  os.write(verdict_fd, str(code).encode('ascii'))  # After the report: the parent's proof that it was printed.
  os.close(verdict_fd)
  return code


if __name__ == '__main__':
  sys.exit(run_program())
