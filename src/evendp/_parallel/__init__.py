"""Layer 3, one process: scatter and gather, replicas, BalancedDataParallel, prediction,
batches collated ahead (prefetch).

Imports only the layers below it."""
