"""remat's benchmark harness and its developers' targets (``python -m benchmarks``, run from the repository's root).

Not installed with the package, and nothing in ``remat`` imports it. ``python -m remat`` is the user's short
demonstration; this is the full set of tables.
"""
