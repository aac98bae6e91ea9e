"""Federated data sets: the embedded digits default, real-data loaders, partitioners.

* `loaders.load_federated_data(dataset, partition, num_clients, seed, ...)`: the runner's entry point; returns a
  `federated.FederatedDataset` (train `ClientData`, central test arrays, OOD test clients where the partition
  has them, input shape, number of classes).
* `partition`: iid, label skew, Dirichlet label skew, quantity skew (NumPy only, deterministic given a seed).
* `colored`: FedCMNIST-style spurious colourings for feature and mixed skew.
* `digits`, `shakespeare`: the embedded digits; Shakespeare's tokenisation.
* `client_data`: `ArrayClientData`, a `tff.simulation.datasets.ClientData` over in-memory arrays.
"""
