"""The engine: saved-tensor hooks, rerun and replay, RNG, autocast, the buffer guard. Imports only leaves."""
