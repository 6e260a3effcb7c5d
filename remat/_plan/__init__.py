"""Deciding what to rematerialize: the rotor-style solver and budgeted chains."""
