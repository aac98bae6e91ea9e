"""Learning algorithms that need more from a client than its model update, as composed `tff.learning` processes.

Each builder returns a `tff.learning.templates.LearningProcess` made with
`tff.learning.templates.compose_learning_process` (TFF's broadcast distributor, a client work of its own, an
aggregation process, TFF's apply-optimizer finalizer); client data reach the server only through
`federated_mean` and the secure-sum family (metrics through the `metrics_aggregator` given, TFF's default
`sum_then_finalize` unless told otherwise).

* `build_elastic_fed_avg`: FedAvg with elastic aggregation (per-parameter sensitivity; `ElasticFactory`).
* `build_fedgma`: FedGMA, the weighted average of the client models plus a step along the AND-masked mean of
  the clients' gradients at the round's starting model.
* `build_scaffold`: SCAFFOLD with client and server control variates; any weighted aggregator (the mean, GMA,
  the geometric median) aggregates its model updates. Clients keep their control variates across rounds through
  `ControlVariateStore` and the process's `next_with_client_controls`.
"""

from tff_gma.learning.elastic import build_elastic_fed_avg
from tff_gma.learning.fedgma import build_fedgma
from tff_gma.learning.personalized_rfa import build_personalized_rfa
from tff_gma.learning.personalized_rfa import PersonalizedProcess
from tff_gma.learning.personalized_rfa import PersonalStore
from tff_gma.learning.scaffold import build_scaffold
from tff_gma.learning.scaffold import ControlVariateStore
from tff_gma.learning.scaffold import ScaffoldProcess

__all__ = [
    'ControlVariateStore',
    'PersonalStore',
    'PersonalizedProcess',
    'ScaffoldProcess',
    'build_elastic_fed_avg',
    'build_fedgma',
    'build_personalized_rfa',
    'build_scaffold',
]
