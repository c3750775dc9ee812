"""Checks shared by the tests that drive the command line in-process.

A refused command is the contract of SPEC section 5: its exit code, a message on stderr that says
what is wrong, no traceback, and nothing on stdout (no report of a plan that was not made)."""

from __future__ import annotations

from fsdp_plan.cli.main import main


def refused(capsys, argv: list[str], *needles: str, code: int = 2) -> str:
    """``fsdp-plan ARGV`` in-process: exit ``code``, every needle in stderr, no traceback, no
    report on stdout; returns stderr."""
    got = main(argv)
    captured = capsys.readouterr()
    assert got == code, captured.err
    assert "Traceback" not in captured.err, captured.err
    assert captured.out == "", captured.out
    for needle in needles:
        assert needle in captured.err, captured.err
    return captured.err
