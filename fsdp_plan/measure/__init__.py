"""Measurement, kept apart from planning: the ground truth a plan is checked against.

- ``memory.measure_peak``: the steady-step peak on the fake process group (FSDPMemTracker);
- ``collectives.count_collectives``: collectives per step on real gloo/NCCL workers;
- ``launch.launch``: the worker launcher with crash/hang detection that both real runs use;
- ``profile``: communication time, hidden and exposed, from a profiler trace.
"""
