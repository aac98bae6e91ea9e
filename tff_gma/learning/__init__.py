"""Learning algorithms that need more than TFF's FedAvg composition, as composed `tff.learning` processes.

Each builder composes TFF's broadcast, a client work, an aggregator and a finalizer with
`tff.learning.templates.compose_learning_process`: GMA with any server optimizer, Elastic FedAvg, FedGMA, SCAFFOLD,
FedProx with the paper's sign and personalized RFA; client data reach the server only through means and secure
sums.
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
from tff_gma.learning.staged import compose_staged_learning_process
from tff_gma.learning.staged import StagedLearningProcess

__all__ = [
    'DEFAULT_LOOP_IMPLEMENTATION',
    'ClientStateOutput',
    'LearningProcessWithClientState',
    'StagedLearningProcess',
    'build_elastic_fed_avg',
    'build_fedgma',
    'build_gma_fed_avg',
    'build_personalized_rfa',
    'build_scaffold',
    'build_weighted_fed_prox',
    'compose_staged_learning_process',
]
