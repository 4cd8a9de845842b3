"""Layer 1, many processes: the process group, counts and losses across ranks, the
uneven sampler, stop agreement and signals. Imports only evendp._core."""
