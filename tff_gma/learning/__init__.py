"""Learning algorithms that need more from a client than its model update, as composed `tff.learning` processes.

Each builder returns a `tff.learning.templates.LearningProcess` made with
`tff.learning.templates.compose_learning_process` (TFF's broadcast distributor, a client work of its own, an
aggregation process, TFF's apply-optimizer finalizer); client data reach the server only through
`federated_mean` and the secure-sum family (metrics through the `metrics_aggregator` given, TFF's default
`sum_then_finalize` unless told otherwise).

* `build_elastic_fed_avg`: FedAvg with elastic aggregation (per-parameter sensitivity; `ElasticFactory`).
* `build_fedgma`: FedGMA, the weighted average of the client models plus a step along the AND-masked mean of
  the clients' gradients at the round's starting model (`tff_gma.aggregators.FedGMAFactory`).
* `build_scaffold`: SCAFFOLD with client and server control variates; any weighted aggregator (the mean, GMA,
  the geometric median) aggregates its model updates.
* `build_personalized_rfa`: personalized RFA (RFA paper, Algorithm 4), shared parameters by RFA, personal ones
  kept by the clients.

SCAFFOLD's and personalized RFA's clients keep values between rounds: their processes are
`LearningProcessWithClientState`s, whose `next_with_client_state` also returns those values (see its docstring).
"""

from tff_gma.learning.client_lib import ClientStateOutput
from tff_gma.learning.client_lib import LearningProcessWithClientState
from tff_gma.learning.elastic import build_elastic_fed_avg
from tff_gma.learning.fedgma import build_fedgma
from tff_gma.learning.personalized_rfa import build_personalized_rfa
from tff_gma.learning.scaffold import build_scaffold

__all__ = [
    'ClientStateOutput',
    'LearningProcessWithClientState',
    'build_elastic_fed_avg',
    'build_fedgma',
    'build_personalized_rfa',
    'build_scaffold',
]
