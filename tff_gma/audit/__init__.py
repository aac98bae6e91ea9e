"""Privacy audit of TFF aggregations: where, how, and how often client data reaches the server.

`audit_computation(comp, policy=AuditPolicy())` walks a computation's building blocks and returns an `AuditReport`
(`.ok`, `.violations`, `.flows`, `.aggregation_passes`, `.to_markdown()`, `.to_json()`); the command line
`python -m tff_gma.audit module:attr [--value_type float32[10]]` prints that report and exits 0 (PASS), 1
(violations) or 2 (an error: no verdict). See `tff_gma.audit.static` for what is analysed and how, and
`AUDIT_SCOPE` (in every report) for what a PASS establishes and what it does not: it says which intrinsics carry
client data to the server, not that an allowed aggregate reveals little about one client.

The empirical checks that retrain clients (RFA's effective weights, membership inference) belong to the
experiment harness (`training.engine.rfa_weights`, `training.engine.membership_attack`), not to this static audit.
"""

from tff_gma.audit.static import AUDIT_SCOPE
from tff_gma.audit.static import CLIENT_WORK
from tff_gma.audit.static import COMPONENTS
from tff_gma.audit.static import AuditPolicy
from tff_gma.audit.static import AuditReport
from tff_gma.audit.static import ComputationAudit
from tff_gma.audit.static import DEFAULT_ALLOWED_INTRINSICS
from tff_gma.audit.static import DEFAULT_POLICY
from tff_gma.audit.static import DISTRIBUTOR
from tff_gma.audit.static import DYNAMIC
from tff_gma.audit.static import FINALIZER
from tff_gma.audit.static import Flow
from tff_gma.audit.static import KEYED_SELECT_INTRINSICS
from tff_gma.audit.static import MEAN_INTRINSICS
from tff_gma.audit.static import METRICS_AGGREGATOR
from tff_gma.audit.static import MODEL_AGGREGATOR
from tff_gma.audit.static import PLAIN_SUM_INTRINSICS
from tff_gma.audit.static import SECURE_SUM_INTRINSICS
from tff_gma.audit.static import Violation
from tff_gma.audit.static import audit_computation

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
