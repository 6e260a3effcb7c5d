"""`remat.apply(model, budget=..., memory=...)`: profile, cost, solve and check a plan for a whole model."""
