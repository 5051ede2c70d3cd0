"""Discrete-event cluster simulator: the library's router, policies, packers and engine
scheduler on a virtual clock, with step times from a batch-time predictor."""
