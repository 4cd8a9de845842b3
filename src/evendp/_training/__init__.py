"""Layer 4, training: strategies, the Trainer, OOM re-split, checkpoints, state, evaluation,
callbacks and loggers, the report, and rehearsals on budgeted CPU virtual devices.

Imports only the layers below it."""
