"""Layer 0, arithmetic: errors, validation, sizes from weights or costs, the exactness core.

Imports nothing else of evendp. See docs/architecture.md."""
