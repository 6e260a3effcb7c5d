"""`remat.apply`'s front door: one dispatch on the request (remat/_core/requests.py) to its driver, and the drivers
that need the estimator (`memory=`)."""
