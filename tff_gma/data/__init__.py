"""Federated data sets: the embedded digits default and partitioners."""
