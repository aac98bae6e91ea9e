"""Privacy audit of TFF aggregations: where, how, and how often client data reaches the server.

`audit_computation(comp, policy=AuditPolicy())` walks a computation's building blocks and returns an `AuditReport`;
`python -m tff_gma.audit module:attr` prints it and exits 0 (PASS), 1 (violations), 3 (cannot be decided) or 2 (no
verdict). A PASS says which intrinsics carry client data to the server, not that an allowed aggregate reveals little
about one client (`AUDIT_SCOPE`). docs/audit.md has the rest, and the harness's empirical checks beyond it.
"""

__all__ = [
    'AUDIT_SCOPE',
    'CLIENT_WORK',
    'COMPONENTS',
    'AuditPolicy',
    'AuditReport',
    'ComputationAudit',
    'DEFAULT_ALLOWED_INTRINSICS',
    'DEFAULT_POLICY',
    'DISTRIBUTOR',
    'DYNAMIC',
    'FINALIZER',
    'Flow',
    'KEYED_SELECT_INTRINSICS',
    'MEAN_INTRINSICS',
    'METRICS_AGGREGATOR',
    'MODEL_AGGREGATOR',
    'PLAIN_SUM_INTRINSICS',
    'SECURE_SUM_INTRINSICS',
    'Undecided',
    'VERDICTS',
    'Violation',
    'audit_computation',
]


def __getattr__(name: str):
  """The names above, from `tff_gma.audit.static`, imported on first use: `python -m tff_gma.audit` starts the
  target's process before it imports TensorFlow Federated (seconds) for its own analysis."""
  if name in __all__:
    from tff_gma.audit import static  # pylint: disable=g-import-not-at-top
    return getattr(static, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
