"""Instruments: live tensor bytes (the tracker) and one-step measurements."""
