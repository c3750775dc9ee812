"""Stage 7, real runs of a plan: ``fsdp-plan bench`` and ``fsdp-plan tune`` on real workers.

Its modules, in the order a run uses them:

- ``inputs``: ``BenchRequest`` and every other input of a run, checked before a worker starts;
- ``session``: one run's flow: ``prepare`` (read and check), then ``finish`` (result, report,
  exit code);
- ``worker``: one benchmark rank (counts, timed steps, peak, a profiled step); started by
  ``fsdp-plan bench`` or, under torchrun, by ``python -m fsdp_plan.cli.bench_worker``;
- ``overlap``: ``--baseline no-overlap``'s figures and verdict (what overlap saved or cost);
- ``results``: the result files that let reruns be compared, the report, ``--compare``;
- ``refit``: ``--refit``, a hardware file corrected from what a run measured;
- ``timing``: several plans timed on one set of workers, or one with its no-overlap twin
  (what ``tune`` benches);
- ``tune_stages``: the tuning order (baseline, topology, buckets, contention, hooks,
  optimizer overlap, prefetch, checkpointing, reshard) and what each stage proposes;
- ``tune``: the loop over those stages, one knob family at a time, kept when it beats the
  noise;
- ``gpu_check``: the prepared one-shot check of predictions on a real GPU.
"""
