"""``fsdp-plan`` entry point: pick the verb, parse, run, and map errors to exit codes in one place.

    fsdp-plan MODEL --mem 70GB [...]        plan (the default verb)
    fsdp-plan verify PLAN.yaml [MODEL]      dry run on the fake process group
    fsdp-plan bench  PLAN.yaml [MODEL]      real run: counts, time, memory
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback

from fsdp_plan.errors import EXIT_BAD_INPUT, FsdpPlanError

VERBS = {"verify": "fsdp_plan.cli.verify", "bench": "fsdp_plan.cli.bench"}
PLAN_VERB = "fsdp_plan.cli.plan"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as a one-paragraph message with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"fsdp-plan: error: {message}. Run `{self.prog} --help` for the options.\n")
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object]:
    """The parser and command module for ``argv`` (verb first, or the plan verb)."""
    if argv and argv[0] in VERBS:
        module = importlib.import_module(VERBS[argv[0]])
        prog = f"fsdp-plan {argv[0]}"
    else:
        module = importlib.import_module(PLAN_VERB)
        prog = "fsdp-plan"
    parser = _Parser(prog=prog, description=(module.__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--debug", action="store_true",
                        help="show Python tracebacks for errors (for bug reports)")
    module.add_arguments(parser)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the SPEC exit code (0 plan written, 2 bad input, 3 no plan fits)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, module = build_parser(argv)
    try:
        args = parser.parse_args(argv[1:] if argv and argv[0] in VERBS else argv)
    except SystemExit as e:  # usage errors (2) and --help (0), already printed
        return int(e.code or 0)
    # FakeTensorMode logs a whole traceback at ERROR level when a meta kernel rejects the
    # model's inputs; the planner reports that error as one paragraph (--debug keeps the log).
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    if not args.debug:
        fake_log.setLevel(logging.CRITICAL)
    try:
        return int(module.run(args) or 0)
    except FsdpPlanError as e:
        if args.debug:
            traceback.print_exc()
        sys.stderr.write(f"fsdp-plan: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("fsdp-plan: interrupted; nothing was written.\n")
        return 130
    finally:
        fake_log.setLevel(level)


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
