"""Learning algorithms that need more than TFF's FedAvg composition, as composed `tff.learning` processes.

Each builder returns a `tff.learning.templates.LearningProcess` made with
`tff.learning.templates.compose_learning_process` (TFF's broadcast distributor, a client work, an aggregation
process, a finalizer: TFF's apply-optimizer finalizer unless said otherwise); client data reach the server only
through `federated_mean` and the secure-sum family (metrics through the `metrics_aggregator` given, TFF's
default `sum_then_finalize` unless told otherwise).

* `build_gma_fed_avg`: GMA with any server optimizer (the GMA paper's Algorithm 2: FedAvg, FedAdam, FedYogi):
  TFF's client work, the optimizer's state updated with the unmasked weighted mean and the GMA mask applied to
  its step (`gma_fed_avg.build_gma_finalizer`). For an SGD server it equals TFF's FedAvg with
  `tff_gma.aggregators.GradientMaskedFactory` as `model_aggregator`, which masks before the optimizer.
* `build_elastic_fed_avg`: FedAvg with elastic aggregation (per-parameter sensitivity; `ElasticFactory`).
* `build_fedgma`: FedGMA, the weighted average of the client models plus a step along the AND-masked mean of
  the clients' gradients at the round's starting model (`tff_gma.aggregators.FedGMAFactory`).
* `build_scaffold`: SCAFFOLD with client and server control variates; any weighted aggregator (the mean, GMA,
  the geometric median) aggregates its model updates.
* `build_weighted_fed_prox`: FedProx with the paper's proximal term, + mu * (w - w_t) (TFF 0.87's
  `tff.learning.algorithms.build_weighted_fed_prox` has the opposite sign; `fed_prox`).
* `build_personalized_rfa`: personalized RFA (RFA paper, Algorithm 4), shared parameters by RFA, personal ones
  kept by the clients.

SCAFFOLD's and personalized RFA's clients keep values between rounds: their processes are
`LearningProcessWithClientState`s, whose `next_with_client_state` also returns those values (see its docstring).

`DEFAULT_LOOP_IMPLEMENTATION` (TFF's DATASET_ITERATOR) is the training loop of the TFF client works built here and
in the harness (see `client_lib`).
"""

from tff_gma.learning.client_lib import DEFAULT_LOOP_IMPLEMENTATION
from tff_gma.learning.client_lib import ClientStateOutput
from tff_gma.learning.client_lib import LearningProcessWithClientState
from tff_gma.learning.elastic import build_elastic_fed_avg
from tff_gma.learning.fed_prox import build_weighted_fed_prox
from tff_gma.learning.fedgma import build_fedgma
from tff_gma.learning.gma_fed_avg import build_gma_fed_avg
from tff_gma.learning.personalized_rfa import build_personalized_rfa
from tff_gma.learning.scaffold import build_scaffold

__all__ = [
    'DEFAULT_LOOP_IMPLEMENTATION',
    'ClientStateOutput',
    'LearningProcessWithClientState',
    'build_elastic_fed_avg',
    'build_fedgma',
    'build_gma_fed_avg',
    'build_personalized_rfa',
    'build_scaffold',
    'build_weighted_fed_prox',
]
