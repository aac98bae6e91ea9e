"""Federated data sets: the embedded digits default, real-data loaders, partitioners.

`loaders.load_federated_data(dataset, partition, num_clients, seed, ...)` is the runner's entry point and returns a
`federated.FederatedDataset`; `partition` and `colored` split and colour labelled pools, `digits` and
`shakespeare` hold the embedded digits and Shakespeare's tokenisation, `client_data` the `ArrayClientData`.
"""
