"""Layer 3, one process: scatter and gather, replicas, BalancedDataParallel, prediction.

Imports only the layers below it."""
