"""Benchmarks of forgeflow's core operations (run as modules: ``python -m benchmarks.<name>``).

They print ratios to their targets; they are not timed tests and never fail on speed.
"""
