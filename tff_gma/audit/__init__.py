"""Privacy audit of TFF aggregations: where, how, and how often client data reaches the server.

`audit_computation(comp, policy=AuditPolicy())` walks a computation's building blocks and returns an `AuditReport`;
`python -m tff_gma.audit module:attr` prints it and exits 0 (PASS), 1 (violations), 3 (cannot be decided) or 2 (no
verdict). A PASS says which intrinsics carry client data to the server, not that an allowed aggregate reveals little
about one client (`AUDIT_SCOPE`).
"""

import importlib

# Each public name, and the module of this package that defines it.
_MODULE_OF = {
    'AUDIT_SCOPE': 'report',
    'COMPONENTS': 'report',
    'AnalysisTimeout': 'walker',
    'AuditPolicy': 'policy',
    'AuditReport': 'report',
    'ComputationAudit': 'report',
    'Flow': 'report',
    'Undecided': 'report',
    'Violation': 'report',
    'audit_computation': 'static',
}

__all__ = [
    'AUDIT_SCOPE',
    'COMPONENTS',
    'AnalysisTimeout',
    'AuditPolicy',
    'AuditReport',
    'ComputationAudit',
    'Flow',
    'Undecided',
    'Violation',
    'audit_computation',
]


def __getattr__(name: str):
  """The names above, imported on first use: `python -m tff_gma.audit` starts the target's process before it
  imports TensorFlow Federated (seconds) for its own analysis."""
  if name in _MODULE_OF:
    return getattr(importlib.import_module(f'{__name__}.{_MODULE_OF[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
