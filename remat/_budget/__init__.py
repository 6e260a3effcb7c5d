"""`remat.apply(model, budget=..., memory=...)`: a plan for a whole model, made in four stages (profile, costs,
solve, verify) by the driver in apply.py."""
