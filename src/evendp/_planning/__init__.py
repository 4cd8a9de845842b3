"""Layer 2, planning: devices, memory specs, the planner, speed balance, launch plans.

Imports only the layers below it (_core, _distributed)."""
