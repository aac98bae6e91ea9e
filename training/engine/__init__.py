"""Builds methods: the registry of aggregators and algorithms, the FedAvg family, client execution, corruption."""
