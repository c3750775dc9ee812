"""``--no-cache``, the same flag on every verb that analyses a model (plan, predict, verify,
tune, and trace with ``--plan``: DDP's bucket cap, ``--refit``'s compute): each reads the model's facts from the cache on
disk, and writes those it traced, unless told not to ([Note: the facts cache] in
facts/cache.py)."""

from __future__ import annotations

import argparse

from fsdp_plan.facts.cache import FactsCache


def add_no_cache(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-cache", action="store_true",
                        help="trace the model afresh instead of reading its facts from the "
                        "cache (~/.cache/fsdp-plan, $XDG_CACHE_HOME or $FSDP_PLAN_CACHE_DIR), "
                        "and write none; FSDP_PLAN_NO_CACHE=1 does the same")


def facts_cache_of(args: argparse.Namespace) -> FactsCache | None:
    """The facts cache, unless ``--no-cache`` or ``FSDP_PLAN_NO_CACHE`` switch it off."""
    return None if args.no_cache else FactsCache.default()
