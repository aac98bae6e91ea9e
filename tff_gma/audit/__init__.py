"""Privacy audit of TFF aggregations: where, how, and how often client data reaches the server.

`audit_computation(comp, policy=AuditPolicy())` walks a computation's building blocks and returns an `AuditReport`
(`.ok`, `.violations`, `.flows`, `.aggregation_passes`, `.to_markdown()`, `.to_json()`); the command line
`python -m tff_gma.audit module:attr [--value_type float32[10]]` prints that report and exits non-zero on
violations. See `tff_gma.audit.static` for what is analysed and how.

Empirical checks, run by the simulation harness (never by the deployed computation):
`tff_gma.audit.rfa_weights` replays RFA's secure averages to report the largest normalized client weight of a
round (RFA paper, Prop. 3; `rfa_weight_report`, `RfaWeightMonitor`), and `tff_gma.audit.membership` runs a
logistic-regression membership-inference attack on a model's logits (GMA paper, App. F; `membership_attack`).
"""

from tff_gma.audit import membership
from tff_gma.audit import rfa_weights
from tff_gma.audit.membership import membership_attack
from tff_gma.audit.rfa_weights import DominatedAggregateWarning
from tff_gma.audit.rfa_weights import RfaSettings
from tff_gma.audit.rfa_weights import RfaWeightMonitor
from tff_gma.audit.rfa_weights import rfa_weight_report
from tff_gma.audit.static import AuditPolicy
from tff_gma.audit.static import AuditReport
from tff_gma.audit.static import ComputationAudit
from tff_gma.audit.static import DEFAULT_ALLOWED_INTRINSICS
from tff_gma.audit.static import DEFAULT_POLICY
from tff_gma.audit.static import DYNAMIC
from tff_gma.audit.static import Flow
from tff_gma.audit.static import KEYED_SELECT_INTRINSICS
from tff_gma.audit.static import MEAN_INTRINSICS
from tff_gma.audit.static import PLAIN_SUM_INTRINSICS
from tff_gma.audit.static import SECURE_SUM_INTRINSICS
from tff_gma.audit.static import Violation
from tff_gma.audit.static import audit_computation

__all__ = [
    'AuditPolicy',
    'AuditReport',
    'ComputationAudit',
    'DEFAULT_ALLOWED_INTRINSICS',
    'DEFAULT_POLICY',
    'DYNAMIC',
    'DominatedAggregateWarning',
    'Flow',
    'KEYED_SELECT_INTRINSICS',
    'MEAN_INTRINSICS',
    'PLAIN_SUM_INTRINSICS',
    'RfaSettings',
    'RfaWeightMonitor',
    'SECURE_SUM_INTRINSICS',
    'Violation',
    'audit_computation',
    'membership',
    'membership_attack',
    'rfa_weight_report',
    'rfa_weights',
]
