"""Explicit prefetch lists as uniform depths, and back: the one form fsdp-plan plans, predicts
and tunes (plan/check.py refuses any other form for every verb)."""

from __future__ import annotations

from fsdp_plan.common.errors import BadInput

MAX_FORWARD_DEPTH = 3
MAX_BACKWARD_DEPTH = 4


def prefetch_maps(unit_keys: list[str], forward_depth: int, backward_depth: int
                  ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The plan's explicit prefetch lists for prefetch depths over the non-root units.

    Forward depth 1 makes each unit prefetch the next; backward depth 1 is FSDP2's implicit
    prefetch (no lists); depth ``d > 1`` lists the ``d`` units before it in backward order."""
    keys = [k for k in unit_keys if k]
    forward = {}
    if forward_depth:
        forward = {a: keys[i + 1: i + 1 + forward_depth] for i, a in enumerate(keys)
                   if keys[i + 1: i + 1 + forward_depth]}
    backward = {}
    if backward_depth > 1:
        rev = list(reversed(keys))
        backward = {a: rev[i + 1: i + 1 + backward_depth] for i, a in enumerate(rev)
                    if rev[i + 1: i + 1 + backward_depth]}
    return forward, backward


def uniform_depths(unit_keys: list[str], forward: dict[str, list[str]],
                   backward: dict[str, list[str]]) -> tuple[int, int] | None:
    """The (forward, backward) depths whose lists (``prefetch_maps``) are these, or None."""
    for fwd in range(MAX_FORWARD_DEPTH + 1):
        for bwd in range(1, MAX_BACKWARD_DEPTH + 1):
            if prefetch_maps(unit_keys, fwd, bwd) == (forward, backward):
                return fwd, bwd
    return None


def prefetch_depths(plan) -> tuple[int, int]:
    """The prefetch depths of ``plan``'s lists, or ``BadInput`` (a plan read by ``read_plan``
    always has them; a ``Plan`` built in code may not)."""
    depths = uniform_depths([u.key for u in plan.units], plan.forward_prefetch,
                            plan.backward_prefetch)
    if depths is None:
        raise BadInput("the plan's forward_prefetch/backward_prefetch lists are not a uniform "
                       "depth (each unit prefetching the next d units in forward, or the d "
                       "before it in backward); fsdp-plan predicts such uniform prefetch only. "
                       "Write the lists as fsdp-plan does, or leave them empty.")
    return depths
