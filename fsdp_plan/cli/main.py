"""``fsdp-plan`` entry point: pick the verb, parse, run, and map errors to exit codes in one place.

    fsdp-plan MODEL --mem 70GB [...]        plan (the default verb)
    fsdp-plan verify PLAN.yaml [MODEL]      dry run on the fake process group
    fsdp-plan bench  PLAN.yaml [MODEL]      real run: counts, time, memory
    fsdp-plan emit   PLAN.yaml -o POLICY.py the policy module of a plan file
    fsdp-plan export PLAN.yaml --to FRAMEWORK -o DIR   framework files made from a plan

[Note: exit codes] SPEC 2: 0 success, 2 bad input, 3 no plan fits, 1 a check failed. Every
error reaches the user as one paragraph on stderr, never a Python traceback (``--debug``
shows it). fsdp-plan's own errors (``fsdp_plan.common.errors``) carry their code. Of the rest,
what the machine or the input caused is exit 2: a file or device operation that failed
(``OSError``), memory exhausted (``MemoryError``), nesting too deep (``RecursionError``), and
``sys.exit`` called by the user's model code, and any other ``BaseException`` that is not
Ctrl-C's ``KeyboardInterrupt`` or fsdp-plan's own ``Stop`` (``GeneratorExit``, a model's
``class Boom(BaseException)``: issue 31, S4-07). Anything else is a bug, in fsdp-plan or in code
it ran: exit 1, as Python's own uncaught-exception exit, with "internal error ... rerun with
--debug and report it".
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import traceback
import types

from fsdp_plan.cli import plan as plan_verb
from fsdp_plan.cli.process import ReportChannel, end_process, mark_process_ends_after_command
from fsdp_plan.common.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, FsdpPlanError, Stop
from fsdp_plan.common.files import forget_umask, remember_umask
from fsdp_plan.common.torch_warnings import artefacts_hidden

VERBS = {"verify": "fsdp_plan.cli.verify", "bench": "fsdp_plan.cli.bench",
         "predict": "fsdp_plan.cli.predict", "calibrate": "fsdp_plan.cli.calibrate",
         "tune": "fsdp_plan.cli.tune", "emit": "fsdp_plan.cli.emit",
         "export": "fsdp_plan.cli.export", "trace": "fsdp_plan.cli.trace"}
"""The other verbs' modules, imported by name only when the verb is given: most import torch
(about 6 s) before their work, which ``fsdp-plan --help`` and the plan verb's flag checks do
not wait for. The plan verb imports no torch until it runs, so it is imported above
(tests/test_architecture.py checks both)."""
PLAN_VERB = plan_verb.__name__


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as a one-paragraph message with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"fsdp-plan: error: {message}. Run `{self.prog} --help` for the options.\n")
        raise SystemExit(EXIT_BAD_INPUT)


def verb_summary(module_name: str) -> str:
    """The first line of a verb module's docstring, read without importing the module."""
    try:
        spec = importlib.util.find_spec(module_name)
        with open(spec.origin, encoding="utf-8") as f:  # type: ignore[union-attr]
            doc = ast.get_docstring(ast.parse(f.read())) or ""
    except (ImportError, OSError, SyntaxError, ValueError, AttributeError, TypeError):
        return "(unavailable)"
    return doc.strip().splitlines()[0] if doc.strip() else ""


def verbs_help() -> str:
    """The verbs block of ``fsdp-plan --help``: every verb in ``VERBS`` with its one-line summary."""
    width = max(len(v) for v in VERBS)
    lines = [f"  {verb:<{width}}  {verb_summary(module)}" for verb, module in VERBS.items()]
    return ("verbs (fsdp-plan VERB --help shows each one's options):\n" + "\n".join(lines)
            + "\n\nexit codes: 0 success, 1 a check failed (or an internal error), 2 bad "
              "input, 3 no plan fits.")


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, types.ModuleType]:
    """The parser and command module for ``argv`` (verb first, or the plan verb)."""
    if argv and argv[0] in VERBS:
        module = importlib.import_module(VERBS[argv[0]])
        prog = f"fsdp-plan {argv[0]}"
        extra = {}
    else:
        module = plan_verb
        prog = "fsdp-plan"
        extra = {"epilog": verbs_help(), "formatter_class": argparse.RawDescriptionHelpFormatter,
                 "usage": f"{prog} MODEL --mem BUDGET [options]\n       {prog} VERB ... "
                          f"(VERB: {', '.join(VERBS)})"}
    parser = _Parser(prog=prog, description=(module.__doc__ or "").strip().splitlines()[0],
                     **extra)
    parser.add_argument("--debug", action="store_true",
                        help="show Python tracebacks for errors (for bug reports)")
    module.add_arguments(parser)
    return parser, module


def _one_line(text: str, limit: int = 600) -> str:
    """An exception's text as one printable line (it may quote hostile input)."""
    text = " ".join(str(text).split())
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _innermost_frame(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {os.path.basename(last.filename)} line {last.lineno})"


def describe_unexpected(error: BaseException) -> tuple[str, int]:
    """The one-paragraph message and exit code for an error that is not fsdp-plan's own
    (see [Note: exit codes])."""
    detail = _one_line(error) or "no message"
    code = EXIT_BAD_INPUT
    if isinstance(error, MemoryError):
        message = ("ran out of host memory (MemoryError); the model, its inputs or the plan need "
                   "more memory than this machine has. Try a smaller model argument, batch or "
                   "world size.")
    elif isinstance(error, RecursionError):
        message = (f"Python's recursion limit was reached ({detail}){_innermost_frame(error)}; "
                   "the model or an input nests too deeply to be walked.")
    elif isinstance(error, OSError):
        name = f" {error.filename!r}" if getattr(error, "filename", None) else ""
        message = (f"a file or device operation failed: {error.strerror or detail}{name} "
                   f"({type(error).__name__}). Check the path, its permissions and the free space.")
    else:
        code = EXIT_CHECK_FAILED
        message = (f"internal error: {type(error).__name__}: {detail}{_innermost_frame(error)}. "
                   "This is a bug in fsdp-plan or in code it ran (your model's, if the place "
                   "above is in your file); rerun with --debug and report it.")
    return message, code


def _dropped(_record: logging.LogRecord) -> bool:
    """A logger filter that lets no record through."""
    return False


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the SPEC exit code (0 ok, 1 check failed, 2 bad input, 3 no
    plan fits). Nothing but ``KeyboardInterrupt``'s 130 and those codes leaves this function."""
    argv = list(sys.argv[1:] if argv is None else argv)
    remember_umask()  # before any model is imported (common/files.py [Note: output files])
    debug = "--debug" in argv
    # FakeTensorMode logs a whole traceback at ERROR level when a meta kernel rejects the
    # model's inputs; the planner reports that error as one paragraph (--debug keeps the log).
    # A filter, not a level: importing torch (later, when a verb needs it) resets the levels
    # of torch's loggers, and with them a level set here.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    try:
        parser, module = build_parser(argv)
        try:
            args = parser.parse_args(argv[1:] if argv and argv[0] in VERBS else argv)
        except SystemExit as e:  # usage errors (2) and --help (0), already printed
            return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
        debug = args.debug
        if not debug:
            fake_log.addFilter(_dropped)
        # [Note: warnings of the planner's passes] in common/torch_warnings.py
        quiet = contextlib.nullcontext() if debug else artefacts_hidden()
        try:
            with quiet:
                return int(module.run(args) or 0)
        except SystemExit as e:  # sys.exit() in the user's model code: not a result of ours
            raise FsdpPlanError(f"the run was stopped by sys.exit({e.code!r}), called by the "
                                "model's code or a library it uses; nothing was written. Remove "
                                "the call (a model file is imported, not run as a script).") from e
    except FsdpPlanError as e:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"fsdp-plan: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("fsdp-plan: interrupted; nothing was written.\n")
        return 130
    except Exception as e:  # noqa: BLE001 - every other error, see [Note: exit codes]
        if debug:
            traceback.print_exc()
        message, code = describe_unexpected(e)
        sys.stderr.write(f"fsdp-plan: {message}\n")
        return code
    except BaseException as e:  # noqa: BLE001 - GeneratorExit, a model's own BaseException
        if debug:
            traceback.print_exc()
        if isinstance(e, Stop):  # a stopping signal no verb caught: its 128 + signal
            sys.stderr.write(f"fsdp-plan: {_one_line(e) or type(e).__name__}; nothing was "
                             "written.\n")
            return int(getattr(e, "exit_code", EXIT_CHECK_FAILED))
        sys.stderr.write(f"fsdp-plan: the run was stopped by {type(e).__name__}"
                         f"{': ' + _one_line(e, 300) if str(e) else ''}{_innermost_frame(e)}, "
                         "a BaseException that is not an Exception, raised by the model's code or "
                         "a library it uses; nothing was written. Raise an Exception subclass "
                         "instead.\n")
        return EXIT_BAD_INPUT
    finally:
        fake_log.removeFilter(_dropped)
        forget_umask()


def entry() -> None:
    """The console script: the command, with stdout kept for its report and an end that the
    model's threads and forked children cannot hold up (process.py)."""
    channel = ReportChannel()
    channel.open()
    mark_process_ends_after_command()
    try:
        code = main()
    finally:
        channel.close()
    end_process(code)


if __name__ == "__main__":
    entry()
