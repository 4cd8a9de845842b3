"""Layer 0, the base: errors, validation, sizes from weights or costs, the exactness core,
and the small helpers every layer shares (units, tables, digests, OOM classification).

Imports nothing else of evendp. See docs/architecture.md."""
