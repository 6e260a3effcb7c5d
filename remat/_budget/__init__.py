"""`remat.apply(model, budget=..., memory=...)`: a plan for a whole model, made in four stages (profile, costs,
solve, verify) by the driver in driver.py. remat.apply(memory=...) reaches it through remat/_apply/memory.py."""
