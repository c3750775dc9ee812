"""Typed errors, mapped to the SPEC exit codes in one place (``exit_code_for``)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_NO_FEASIBLE_PLAN = 3
EXIT_CHECK_FAILED = 1


class FsdpPlanError(Exception):
    """Base of every error the command reports as a one-paragraph message."""

    exit_code: int = EXIT_BAD_INPUT


class BadInput(FsdpPlanError):
    """The user's model, arguments or files are wrong; the message names the value and the fix."""

    exit_code = EXIT_BAD_INPUT


class NoFeasiblePlan(FsdpPlanError):
    """No candidate fits the budget; carries the smallest peak any plan reached."""

    exit_code = EXIT_NO_FEASIBLE_PLAN

    def __init__(self, message: str, smallest_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.smallest_peak_bytes = smallest_peak_bytes


class CheckFailed(FsdpPlanError):
    """``verify``/``bench`` measured something that disagrees with the plan."""

    exit_code = EXIT_CHECK_FAILED


class Stop(BaseException):
    """Base of fsdp-plan's own ``BaseException``s (a stopping signal's ``Terminated``): they
    pass through every guard around the user's code, which turns any other ``BaseException``
    raised there into a ``BadInput`` (model/load.py [Note: calling user code])."""


def exit_code_for(error: BaseException) -> int:
    """The process exit code for an error raised anywhere in the pipeline."""
    if isinstance(error, FsdpPlanError):
        return error.exit_code
    return EXIT_BAD_INPUT
