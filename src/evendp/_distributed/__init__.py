"""Layer 1, many processes: the process group, counts and losses across ranks, the
uneven sampler, the step's global count, stop agreement and signals, a stalled rank, one
error for all ranks, the run folder's lock and private files, ``StepMean``/``EngineMean``
for hand-written loops, and torchrun as ``evendp launch`` runs it. Imports only
evendp._core."""
