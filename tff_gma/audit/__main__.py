"""Command line: audit a TFF computation, process or factory and print the report.

  python -m tff_gma.audit MODULE:ATTR [--value_type float32[10]] [--weight_type float32]
                                      [--policy default|allow-plain-sum] [--allow URI]... [--format markdown|json]
                                      [--output PATH]

`MODULE:ATTR` names a `tff.Computation`, an `AggregationProcess` / `LearningProcess` (or other
`IterativeProcess`), an aggregation factory (give `--value_type`), or a zero-argument callable returning one of
these. A type is `DTYPE` or `DTYPE[D1,D2,...]` (a `?` dimension is unknown), or `MODULE:ATTR` naming a `tff.Type`.

Exit status: 0 when the policy is met, 1 when there are violations, 2 on usage or loading errors. The audit is
static: the command installs no execution context and starts no TFF worker.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, Optional

_TENSOR_TYPE = re.compile(r'^\s*(?P<dtype>[A-Za-z][A-Za-z0-9_]*)\s*(?:\[(?P<dims>[^\]]*)\])?\s*$')
EXIT_OK = 0
EXIT_VIOLATIONS = 1
EXIT_USAGE = 2


def load_attribute(spec: str) -> Any:
  """`'package.module:name.attr'` -> that object."""
  module_name, sep, attr_path = spec.partition(':')
  if not sep or not module_name or not attr_path:
    raise ValueError(f'expected MODULE:ATTR, got {spec!r}')
  value = importlib.import_module(module_name)
  for part in attr_path.split('.'):
    value = getattr(value, part)
  return value


def parse_type(spec: Optional[str]):
  """A CLI type spec -> `tff.Type` (`None` stays `None`)."""
  if spec is None:
    return None
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  if ':' in spec:
    return tff.to_type(load_attribute(spec))
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


def _resolve_subject(value: Any) -> Any:
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  supported = (tff.Computation, tff.templates.IterativeProcess, tff.aggregators.UnweightedAggregationFactory,
               tff.aggregators.WeightedAggregationFactory)
  if not isinstance(value, supported) and callable(value):
    value = value()  # A builder: lets a module define expensive targets lazily.
  return value


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='python -m tff_gma.audit',
      description='Static audit of where client data reaches the server in a TFF computation.')
  parser.add_argument('target', help='MODULE:ATTR of a computation, process, factory, or a builder of one')
  parser.add_argument('--value_type', help='value type for a factory, e.g. float32[10]')
  parser.add_argument('--weight_type', help='weight type for a weighted factory (default float32)')
  parser.add_argument('--policy', choices=('default', 'allow-plain-sum'), default='default',
                      help='default: means and secure sums only; allow-plain-sum: also federated_sum')
  parser.add_argument('--allow', action='append', default=[], metavar='URI',
                      help='also allow this intrinsic (repeatable), e.g. federated_max')
  parser.add_argument('--format', choices=('markdown', 'json'), default='markdown')
  parser.add_argument('--output', help='also write the report to this file')
  return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
  try:
    subject = _resolve_subject(load_attribute(args.target))
    value_type = parse_type(args.value_type)
    weight_type = parse_type(args.weight_type)
    policy = static.AuditPolicy(
        allowed_intrinsics=static.DEFAULT_ALLOWED_INTRINSICS | frozenset(args.allow),
        allow_plain_sum=args.policy == 'allow-plain-sum')
    report = static.audit_computation(subject, policy=policy, value_type=value_type, weight_type=weight_type,
                                      name=args.target)
  except (ImportError, AttributeError, ValueError, TypeError) as e:
    print(f'error: {type(e).__name__}: {e}', file=sys.stderr)
    return EXIT_USAGE
  text = report.to_markdown() if args.format == 'markdown' else report.to_json()
  print(text)
  if args.output:
    with open(args.output, 'w') as f:
      f.write(text + '\n')
  return EXIT_OK if report.ok else EXIT_VIOLATIONS


def run_program() -> int:
  """Entry point of `python -m tff_gma.audit`: `main` with no execution context installed."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  # pylint: disable=g-import-not-at-top
  from tensorflow_federated.python.core.impl.context_stack import set_default_context
  # pylint: enable=g-import-not-at-top
  # Auditing executes nothing: with no default context nothing can start TFF's worker, and the context TFF installed
  # at import (which would start one lazily) is released now rather than during interpreter shutdown.
  set_default_context.set_no_default_context()
  return main()


if __name__ == '__main__':
  sys.exit(run_program())
