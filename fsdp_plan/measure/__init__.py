"""Stage 6, measurement, kept apart from planning: the ground truth a plan is checked against.

Its modules, from the ground up:

- ``launch``: N local worker processes with crash and hang detection, which every real run uses;
- ``runtime``: rebuild the planned model, build the mesh, apply the plan through its policy
  module, make the optimizer, run a step (the same way for every measurement);
- ``worker_setup``: the start of a real-worker measurement (process group, device, the planned
  model on it, its optimizer and inputs);
- ``measured``: ``MeasuredMemory``, what a memory measurement returns;
- ``tracker``: ``FSDPMemTracker`` that keeps FSDP2's hooks of grouped units;
- ``fake_shards``: FSDP2's padding of absent shards in one step, so any world size is fast;
- ``memory``: an FSDP2 plan's steady-step peak on the fake process group at its world size;
- ``ddp``: a DDP plan's buckets, collectives, step time and peak on real gloo workers;
- ``peak``: ``measured_peak``, the one choice between ``memory`` and ``ddp`` (verify, the API);
- ``allocator``: the CUDA allocator's peak on one GPU (the GPU check);
- ``collectives``: collectives per step on real gloo/NCCL workers (``CommDebugMode``);
- ``trace_read``, ``trace_steps``, ``trace_figures``, ``trace_ranks``: any run's profiler
  traces read (streamed), cut into steps and phases, split as the clock splits a step, with
  DDP buckets and stragglers across ranks (``fsdp-plan trace``); ``intervals``: the sweeps
  they rest on; ``bucket_cap``: the ``bucket_cap_mb`` that built traced buckets;
- ``profile``: bench's profiled steps read by ``trace_ranks`` (its comm and phase figures are
  the trace verb's), and older single annotated steps by the same definitions;
- ``calibrate``: micro-benchmarks of this machine, written as a hardware file.
"""
