"""Scheduling library: priority policies, batch packers, decode selectors, predictors, SLO math.

Plain Python with no Ray import. The engine's scheduler, the router and the simulator all use
these objects; time comes from a clock passed in (`raycluster.clock`).
"""
