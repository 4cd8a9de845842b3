"""Layer 4, training: strategies, the Trainer, OOM re-split, checkpoints, state, report.

Imports only the layers below it."""
