"""Layer 2, measuring: devices, memory specs, the planner, speed balance, launch plans.

Imports only the layers below it (_core, _distributed)."""
