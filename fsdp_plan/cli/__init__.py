"""The command line: a thin layer over the pipeline. One module per verb, each with
``add_arguments(parser)`` and ``run(args) -> int``; ``main`` maps errors to SPEC exit codes."""
