"""The audit's child: imports the target, builds what it names, and sends back its computations as data.

`python -m tff_gma.audit.loader REQUEST_JSON RESULT_FD` (started by the audit command; `isolation` says why) writes
one message on `RESULT_FD`: the computations as serialized `pb.Computation` protos, or an error line; no report,
no verdict. `load_message` is the same work without the process, for tests and trusted callers.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any, Optional

from tff_gma import tff_internals
from tff_gma.audit import isolation
from tff_gma.audit.isolation import CommandError

_TENSOR_TYPE = re.compile(r'^\s*(?P<dtype>[A-Za-z][A-Za-z0-9_]*)\s*(?:\[(?P<dims>[^\]]*)\])?\s*$')
_SUPPORTED = ('a tff.Computation, a tff.templates.IterativeProcess (e.g. an AggregationProcess or LearningProcess), '
              'an aggregation factory, a process in stages (tff_gma.aggregators.StagedAggregationProcess, '
              'tff_gma.learning.StagedLearningProcess), or a zero-argument callable returning one')


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
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # pylint: disable=broad-except  # A BaseException subclass too: the target's code.
    raise CommandError(f'cannot import module {module_name!r} of {role} {spec}: {isolation.describe(e)}') from e
  parts = attr_path.split('.')
  for i, part in enumerate(parts):
    try:
      value = getattr(value, part)
    except AttributeError as e:
      raise CommandError(f'{role} {spec}: module {module_name!r} has no attribute {".".join(parts[:i + 1])!r}') from e
    except (KeyboardInterrupt, SystemExit):
      raise
    except BaseException as e:  # pylint: disable=broad-except  # A property's code may raise any kind.
      raise CommandError(f'{role} {spec}: reading {".".join(parts[:i + 1])!r} raised {isolation.describe(e)}') from e
  return value


def parse_tensor_spec(spec: str) -> tuple[Any, Optional[list[Optional[int]]]]:
  """`DTYPE` or `DTYPE[D1,...]` -> (numpy dtype, dims or None); ValueError naming what is wrong. NumPy only."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  match = _TENSOR_TYPE.match(spec)
  if match is None:
    raise ValueError(f'cannot parse type {spec!r}; expected DTYPE, DTYPE[D1,...] or MODULE:ATTR')
  try:
    dtype = np.dtype(match['dtype'])
  except TypeError as e:
    raise ValueError(f'unknown dtype {match["dtype"]!r} in type {spec!r}') from e
  if match['dims'] is None:
    return dtype, None
  dims = []
  for dim in (d.strip() for d in match['dims'].split(',') if d.strip()):
    if dim in ('?', 'None'):
      dims.append(None)
    elif dim.isdigit():
      dims.append(int(dim))
    else:
      raise ValueError(f'bad dimension {dim!r} in type {spec!r}')
  return dtype, dims


def parse_type(spec: Optional[str]):
  """A CLI type spec -> `tff.Type` (`None` stays `None`). A `MODULE:ATTR` spec imports that module: the child's
  work, never the parent's."""
  if spec is None:
    return None
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  if ':' in spec:
    return tff.to_type(load_attribute(spec, role='type'))
  dtype, dims = parse_tensor_spec(spec)
  return tff.TensorType(dtype) if dims is None else tff.TensorType(dtype, dims)


def parse_type_option(option: str, spec: Optional[str]):
  """`parse_type`, with a failure as a `CommandError` naming the option."""
  try:
    return parse_type(spec)
  except Exception as e:  # pylint: disable=broad-except
    raise CommandError(f'{option} {spec!r}: {e if isinstance(e, ValueError) else isolation.describe(e)}') from e


def resolve_subject(value: Any, spec: str) -> Any:
  """The auditable object a target names: itself, or what calling it (a builder) returns."""
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  from tff_gma.aggregators import staged as aggregators_staged  # pylint: disable=g-import-not-at-top
  from tff_gma.learning import staged as learning_staged  # pylint: disable=g-import-not-at-top
  supported = (tff.Computation, tff.templates.IterativeProcess, tff.aggregators.UnweightedAggregationFactory,
               tff.aggregators.WeightedAggregationFactory, tff.framework.ComputationBuildingBlock,
               aggregators_staged.StagedAggregationProcess, learning_staged.StagedLearningProcess)
  described = f'target {spec} is {type(value).__name__}'
  if tff_internals.is_polymorphic_computation(value):
    raise CommandError(f'target {spec} is a polymorphic computation (no parameter type yet): decorate it with '
                       'its parameter types, or name a builder that returns a typed computation')
  if not isinstance(value, supported) and callable(value):
    try:
      value = value()  # A builder: lets a module define expensive targets lazily.
    except SystemExit as e:
      raise CommandError(f'target {spec}: the builder called sys.exit({e.code!r})') from e
    except KeyboardInterrupt:
      raise
    except BaseException as e:  # pylint: disable=broad-except
      raise CommandError(f'target {spec}: calling the builder raised {isolation.describe(e)}') from e
    described = f'target {spec}() returned {type(value).__name__}'
  if not isinstance(value, supported):
    raise CommandError(f'{described}, which the audit cannot read: expected {_SUPPORTED}')
  return value


def _serialized_computation(comp: Any, name: str) -> bytes:
  """A computation (or building block) as the bytes of its `pb.Computation`, the proto `to_building_block` reads."""
  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff
  from tff_gma.audit import static
  # pylint: enable=g-import-not-at-top
  if isinstance(comp, tff.framework.ConcreteComputation):
    proto = tff.framework.serialize_computation(comp)
  else:
    proto = static._to_building_block(comp, name).proto  # pylint: disable=protected-access
  return proto.SerializeToString()


def _result(subject: Any, value_type: Any, weight_type: Any) -> dict[str, Any]:
  """The result message's body for a resolved subject (the kinds and checks of `static.audit_computation`)."""
  # pylint: disable=g-import-not-at-top
  import tensorflow_federated as tff
  from tff_gma.audit import static
  # pylint: enable=g-import-not-at-top
  # pylint: disable=protected-access
  _, computations, _ = static._subject_computations(subject, value_type, weight_type)
  serialize_type = lambda t: tff.types.serialize_type(t).SerializeToString()
  factories = (tff.aggregators.UnweightedAggregationFactory, tff.aggregators.WeightedAggregationFactory)
  types = {}
  if isinstance(subject, factories):
    kind = 'factory'
    types['value_type'] = serialize_type(tff.to_type(value_type))
    if isinstance(subject, tff.aggregators.WeightedAggregationFactory):
      types['weight_type'] = serialize_type(static._default_weight_type(weight_type))
  elif isinstance(subject, tff.templates.IterativeProcess):
    kind = 'process'
  elif callable(getattr(subject, 'computations', None)):
    kind = 'staged'
  else:
    kind = 'computation'
  # pylint: enable=protected-access
  problem = isolation.computation_names_problem(kind, [n for n, _ in computations])
  if problem is not None:
    raise ValueError(f'{problem}; got {[n for n, _ in computations]}')
  serialized = [(n, _serialized_computation(c, n)) for n, c in computations]
  return isolation.result_body(kind, type(subject).__name__, serialized, **types)


def _memory_error_in(error: BaseException) -> bool:
  """Whether a `MemoryError` caused `error` (the loader's messages wrap what they catch)."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, MemoryError):
      return True
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return False


def out_of_memory_message(target: str) -> str:
  """The one line for a target whose loading ran out of memory: the audit's limit, not the audited code, ended it."""
  import resource  # pylint: disable=g-import-not-at-top
  limit, _ = resource.getrlimit(resource.RLIMIT_AS)
  where = ('' if limit == resource.RLIM_INFINITY else
           f' (the audit limits its process to {isolation.gib(limit)} of address space: --memory_limit)')
  return f'the audit of {target} ran out of memory while loading the target{where}; no verdict'


def load_message(target: str, value_type: Optional[str] = None, weight_type: Optional[str] = None,
                 with_traceback: bool = False) -> bytes:
  """Loads `target` here and returns the message the child sends: its computations, or one error line."""
  try:
    try:
      value_tff_type = parse_type_option('--value_type', value_type)
      weight_tff_type = parse_type_option('--weight_type', weight_type)
      subject = resolve_subject(load_attribute(target), target)
      try:
        body = _result(subject, value_tff_type, weight_tff_type)
      except (KeyboardInterrupt, SystemExit):
        raise
      except BaseException as e:  # pylint: disable=broad-except
        raise CommandError(f'cannot audit {target}: {isolation.describe(e)}') from e
    except SystemExit as e:  # Code the target runs called sys.exit outside the import and the builder.
      raise CommandError(f'{target}: sys.exit({e.code!r}) called while loading it') from e
  except Exception as e:  # pylint: disable=broad-except
    if _memory_error_in(e):
      message = out_of_memory_message(target)
    else:
      message = str(e) if isinstance(e, CommandError) else (
          f'internal error while loading {target}: {isolation.describe(e)}')
    body = isolation.error_body(message, traceback.format_exc() if with_traceback else None)
  return isolation.encode_message(body)


def main(argv: Sequence[str]) -> int:
  """`REQUEST_JSON RESULT_FD`: loads the target, writes the message, exits 0; 130 on Ctrl-C (no message)."""
  request, result_fd = json.loads(argv[0]), int(argv[1])
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  import tensorflow_federated as tff  # pylint: disable=g-import-not-at-top
  # Loading executes nothing: with no default context nothing can start TFF's worker, and the context TFF installed
  # at import (which would start one lazily) is released now rather than during interpreter shutdown.
  tff.test.set_no_default_context()
  try:
    message = load_message(request['target'], request.get('value_type'), request.get('weight_type'),
                           bool(request.get('traceback')))
  except KeyboardInterrupt:  # Ctrl-C (or code that raised it): no message; the parent says so in one line.
    return isolation.EXIT_INTERRUPTED
  except MemoryError:  # Encoding a message too large for the limit: a short one instead.
    message = isolation.encode_message(isolation.error_body(out_of_memory_message(request['target'])))
  with os.fdopen(result_fd, 'wb') as pipe:
    pipe.write(message)
  return 0


if __name__ == '__main__':
  code = main(sys.argv[1:])
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except
      pass
  # No interpreter shutdown: what it would run (TFF's and the target's exit hooks) can only get in the way now.
  os._exit(code)  # pylint: disable=protected-access
