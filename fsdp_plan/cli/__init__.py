"""Stage 8, the command line: a thin layer over the pipeline. One module per verb, each with
``add_arguments(parser)`` and ``run(args) -> int``; ``main`` maps errors to SPEC exit codes.

- ``main``: ``fsdp-plan``, the verb chosen, parsed and run; errors to exit codes;
- ``plan``: the default verb, a plan for a model within a budget;
- ``predict``: a plan file's prediction as written;
- ``verify``: a plan's peak measured (``measure.peak``) against its prediction;
- ``bench``: a plan run on real workers (also the torchrun entry's options);
- ``tune``: a plan tuned by measurement;
- ``calibrate``: this machine measured into a hardware file.
"""
