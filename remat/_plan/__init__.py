"""Deciding what to rematerialize: the solver (rotor chains, whole-model budgets) and its front ends."""
