"""Simulated evaluation at paper scale: cost model, discrete-event xPyD simulator.

Everything in this package is SIMULATED: step times come from an analytic cost
model (:mod:`.cost_model`), not from hardware. The routing decisions are made by
the unchanged policy objects of :mod:`eldr_sglang.core.policies`. No sglang or
aiohttp imports.
"""
