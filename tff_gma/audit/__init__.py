"""Privacy audit of TFF aggregations: where, how, and how often client data reaches the server.

`audit_computation(comp, policy=AuditPolicy())` walks a computation's building blocks and returns an `AuditReport`
(`.ok`, `.violations`, `.flows`, `.aggregation_passes`, `.to_markdown()`, `.to_json()`); the command line
`python -m tff_gma.audit module:attr [--value_type float32[10]]` prints that report and exits 0 (PASS), 1
(violations) or 2 (an error: no verdict); it imports the target in a child process and reaches the verdict in its
own (`tff_gma.audit.isolation` says why). See `tff_gma.audit.static` for what is analysed and how, and
`AUDIT_SCOPE` (in every report) for what a PASS establishes and what it does not: it says which intrinsics carry
client data to the server, not that an allowed aggregate reveals little about one client.

The empirical checks that retrain clients (RFA's effective weights, membership inference) belong to the
experiment harness (`training.engine.rfa_weights`, `training.engine.membership_attack`), not to this static audit.
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
