"""The frontier: the best plan at each budget, so a report can say what more memory buys.

[Note: the frontier]
"What would more memory buy?" is the question behind every budget. For a grid of budgets
from the smallest one at which any plan fits (the smallest peak any plan reaches, all blocks
checkpointed) to the one at which the fastest plan of all fits (with no budget at all; it
needs no checkpointing, and beyond it memory buys nothing), the search runs as planning runs
it (``search.search`` with the standard recipes, ``choose``) and keeps the best plan: its step
time, tokens/s, and the knobs that differ from the budget below (units, fully and selectively
checkpointed blocks, mesh, micro-batch). Every budget keeps the user's headroom rule (10% of
the budget by default, else the same share), so a point of the frontier is what re-planning
with ``--mem`` at that budget chooses. The budgets are round numbers (1, 2 or 5 times a power
of ten bytes) and include the user's own. One evaluator's caches (activation profiles, unit
costs, and every plan evaluated, the planner's search's included) serve every budget
(``Evaluator.with_budget``, [Note: evaluations across budgets]): only what fits changes, so a
budget's search computes only the layouts no search before it met. With several
micro-batch sizes (``--global-batch-size``, ``--batch-size auto``) each budget takes the one
with the most tokens/s, as planning does.

Known limitations: the reduce dtype and gradient sync stay as the plan chose them at the
user's budget; offload (a last resort) is not part of the frontier; a knob can change
between two budgets of the grid and is reported at the upper one.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import time as clock
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_plan.common.collector import cycle_collector_paused
from fsdp_plan.common.errors import NoFeasiblePlan
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.facts.forked import ForkedPasses
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.candidate import Candidate, SearchSettings
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.run import plug_ins_for, run_search

UNLIMITED = 10**18
"""A budget no plan reaches: the search's fastest plan of all."""


@dataclass(kw_only=True)
class Variant:
    """One micro-batch size the frontier searches: ``facts`` analysed at ``micro_batch``."""

    micro_batch: int
    grad_accum_steps: int
    facts: ModelFacts


@dataclass(kw_only=True, frozen=True)
class FrontierPoint:
    """The best plan at one budget (``fits`` False when none fits)."""

    budget_bytes: int
    limit_bytes: int
    fits: bool
    name: str = ""
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    peak_bytes: int = 0
    strategy: str = ""
    mesh: str = ""
    units: int = 0
    full: int = 0
    """Fully checkpointed blocks."""
    selective: int = 0
    """Selectively checkpointed blocks."""
    micro_batch: int = 0
    grad_accum_steps: int = 1
    compiled: bool = False
    """Whether the plan compiles its blocks (``--compile``; with ``--compile auto`` every
    budget weighs eager and compiled variants)."""

    def knobs(self) -> dict[str, Any]:
        """What the frontier reports a change of."""
        return {"blocks": "compiled" if self.compiled else "eager",
                "units": self.units, "full checkpointing": self.full,
                "selective checkpointing": self.selective,
                "mesh": f"{self.strategy} {self.mesh}", "micro-batch": self.micro_batch}


@dataclass(kw_only=True)
class Frontier:
    """Best plans by budget, ascending, with the user's budget among them."""

    points: list[FrontierPoint]
    user_budget_bytes: int
    searches: int
    plans_evaluated: int
    seconds: float
    cpu_seconds: float = 0.0
    """CPU time of this process over the same span (on a shared machine, wall time is not)."""
    complete: bool = True
    """Whether the grid spans the whole range (the report's line searches above the user's
    budget only)."""
    notes: list[str] = field(default_factory=list)

    @property
    def at_user_budget(self) -> FrontierPoint:
        return next(p for p in self.points if p.budget_bytes == self.user_budget_bytes)

    def changes(self) -> list[dict[str, Any]]:
        """Each budget where a knob of the best plan differs from the budget below it."""
        out = []
        fitting = [p for p in self.points if p.fits]
        for below, here in itertools.pairwise(fitting):
            for knob, value in here.knobs().items():
                if below.knobs()[knob] != value:
                    out.append({"budget_bytes": here.budget_bytes, "knob": knob,
                                "from": below.knobs()[knob], "to": value})
        return out

    def more_memory(self, min_gain: float = 0.01) -> FrontierPoint | None:
        """The smallest budget above the user's whose best plan is at least ``min_gain``
        faster (None when more memory buys nothing)."""
        return _first_paying(self.points, self.at_user_budget, min_gain)

    def to_dict(self) -> dict[str, Any]:
        return {"points": [asdict(p) for p in self.points],
                "user_budget_bytes": self.user_budget_bytes, "changes": self.changes(),
                "searches": self.searches, "plans_evaluated": self.plans_evaluated,
                "seconds": round(self.seconds, 3), "cpu_seconds": round(self.cpu_seconds, 3),
                "complete": self.complete,
                "notes": list(self.notes)}


def _first_paying(points: list[FrontierPoint], here: FrontierPoint, min_gain: float = 0.01
                  ) -> FrontierPoint | None:
    """Of ``points`` (ascending budgets), the first above ``here`` whose plan is at least
    ``min_gain`` faster; the first that fits when ``here`` does not."""
    if not here.fits:
        return next((p for p in points if p.fits), None)
    return next((p for p in points if p.budget_bytes > here.budget_bytes and p.fits
                 and p.step_s < here.step_s * (1 - min_gain)), None)


def headroom_rule(budget_bytes: int, headroom_bytes: int) -> Callable[[int], int]:
    """The headroom at any budget: 10% when the user kept the default, else the same share."""
    if headroom_bytes == budget_bytes // 10:
        return lambda b: b // 10
    return lambda b: b * headroom_bytes // budget_bytes


def _budget_for(limit: int, headroom: Callable[[int], int]) -> int:
    """The smallest budget whose limit (budget - headroom) is at least ``limit``."""
    share = headroom(10**12) / 10**12
    budget = max(1, math.ceil(limit / max(1e-9, 1 - share)))
    while budget - headroom(budget) < limit:
        budget += 1
    while budget > 1 and budget - 1 - headroom(budget - 1) >= limit:
        budget -= 1
    return budget


def round_budgets(low: int, high: int, count: int) -> list[int]:
    """About ``count`` round budgets (multiples of 1, 2 or 5 x 10^k bytes, the step nearest
    to an even split) inside ``low..high``."""
    if high <= low or count < 1:
        return []
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = min((m * power for m in (1, 2, 5, 10)), key=lambda v: abs(math.log(v / raw)))
    first = -(-low // step) * step
    return list(range(first, high + 1, step))


@dataclass(frozen=True, kw_only=True)
class _BudgetSearch:
    """One budget's search, as the process that ran it reports it (``points_beside``)."""

    point: FrontierPoint
    pid: int
    """The process that searched it (a forked child's counts are added to the planner's)."""
    searches: int
    evaluations: int
    """Searches and plans evaluated by it."""
    smallest: int
    """The searcher's smallest peak where nothing fitted, after it."""
    cpu_s: float


class _Searcher:
    """The search at any budget for each micro-batch variant, on shared evaluators."""

    def __init__(self, variants: list[Variant], settings: SearchSettings,
                 headroom: Callable[[int], int], seq_len: int,
                 evaluator: Evaluator | None = None) -> None:
        self.variants = variants
        self.headroom = headroom
        self.seq_len = seq_len
        self.searches = 0
        self.strategy = settings.strategy
        self.generators, _ = plug_ins_for(settings.strategy, allow_offload=False)
        self.smallest = UNLIMITED
        """The smallest peak of a search where nothing fitted (its ``NoFeasiblePlan``)."""
        self.evaluators = [evaluator if _serves(evaluator, v.facts, settings)
                           else Evaluator(v.facts.graph, v.facts.analysis, settings)
                           for v in variants]
        """Per variant: the planner's own evaluator when it searched these facts with these
        settings (its caches and every plan it evaluated serve every budget: [Note:
        evaluations across budgets] in search/evaluator.py), else a new one."""
        self._already = sum(e.evaluations for e in {id(e): e for e in self.evaluators}.values())
        self._met: list[list[Candidate]] = [[] for _ in variants]
        """Per variant, the candidates of every budget searched so far: whichever fits a
        new budget bounds its search ([Note: bounded frontier searches])."""
        self._evaluated_elsewhere = 0
        self.cpu_elsewhere = 0.0
        """Plans evaluated and CPU seconds spent in a forked child (``points_beside``)."""

    @property
    def evaluations(self) -> int:
        """Plans evaluated for the frontier (not those the planner's search had evaluated)."""
        unique = {id(e): e for e in self.evaluators}.values()
        return (sum(e.evaluations for e in unique) - self._already
                + self._evaluated_elsewhere)

    def points_beside(self, budgets: list[int]) -> dict[int, FrontierPoint]:
        """The points at ``budgets``, the later ones searched by a forked child beside the
        planner.

        [Note: the page's budgets beside the planner]
        The page's frontier searches every round budget of its grid (the report's line stops
        early), and each search is a pure function of the facts and its budget: the evaluator
        caches and the candidates that bound it ([Note: bounded frontier searches]) only
        spare work, never change the best plan. So once the budgets the grid depends on are
        searched (the user's, none, no limit, its ends), the rest are shared out as the
        analysis passes are (facts/forked.py [Note: passes in forked children]): the planner
        searches the first ones, a child forked with every cache searched so far the later
        ones and sends back each point with what it searched, evaluated and spent; whatever
        goes wrong there, the planner searches that budget itself. The 70B shape's page on a
        2-core machine: its frontier in 1.0-1.1 s instead of 1.4-1.5 (issue 29; stop 42's
        results file). A budget searched
        beside the planner does not bound the planner's later searches, which may evaluate
        a few more plans."""
        found: dict[int, FrontierPoint] = {}
        with ForkedPasses([]) as forked:
            for budget in budgets:
                forked.start(f"budget {budget}", functools.partial(self._searched, budget))
            forked.launch()
            for budget in budgets:
                done = forked.result(f"budget {budget}",
                                     functools.partial(self._searched, budget))
                if done.pid != os.getpid():  # a child's: what it did, counted here
                    self.searches += done.searches
                    self._evaluated_elsewhere += done.evaluations
                    self.smallest = min(self.smallest, done.smallest)
                    self.cpu_elsewhere += done.cpu_s
                found[budget] = done.point
        return found

    def _searched(self, budget: int) -> _BudgetSearch:
        """``point(budget)``, with the process that searched it and what it added to the
        counts."""
        searches, evaluations = self.searches, self.evaluations
        cpu = clock.process_time()
        point = self.point(budget)
        return _BudgetSearch(point=point, pid=os.getpid(), searches=self.searches - searches,
                             evaluations=self.evaluations - evaluations,
                             smallest=self.smallest, cpu_s=clock.process_time() - cpu)

    def ranked_at(self, budget: int) -> list[tuple[Variant, Candidate]]:
        """Every variant's ranking at ``budget`` (best first within each)."""
        out = []
        for variant, base, met in zip(self.variants, self.evaluators, self._met):
            evaluator = base.with_budget(budget, self.headroom(budget))
            evaluator.bound_by(met)
            self.searches += 1
            try:  # the planner's own search, on the shared evaluator
                ranked = run_search(variant.facts, evaluator.settings, self.generators,
                                    evaluator=evaluator).ranked
            except NoFeasiblePlan as e:  # nothing fits this budget
                self.smallest = min(self.smallest, int(e.smallest_peak_bytes or 0) or UNLIMITED)
                continue
            met += ranked
            out += [(variant, c) for c in ranked]
        return out

    def point(self, budget: int, ranked: list[tuple[Variant, Candidate]] | None = None
              ) -> FrontierPoint:
        """The plan with the most tokens/s that fits ``budget`` (of ``ranked``, the search at
        that budget, when given)."""
        limit = budget - self.headroom(budget)
        ranked = self.ranked_at(budget) if ranked is None else ranked
        # each variant's plan is its search's first that fits (the planner's choice, ties in
        # step time within rank()'s rounding included), then the variant with most tokens/s
        firsts: dict[int, tuple[Variant, Candidate]] = {}
        for v, c in ranked:
            if c.fits and id(v) not in firsts:
                firsts[id(v)] = (v, c)
        fitting = [(self._tokens(v, c), v, c) for v, c in firsts.values()]
        if not fitting:
            return FrontierPoint(budget_bytes=budget, limit_bytes=limit, fits=False)
        tokens, variant, best = max(fitting, key=lambda t: (t[0], -t[2].memory.peak_bytes))
        return FrontierPoint(
            budget_bytes=budget, limit_bytes=limit, fits=True, name=best.name,
            step_s=best.time.step_s, tokens_per_s=tokens, peak_bytes=best.memory.peak_bytes,
            strategy=best.strategy, mesh=f"{best.replicate}x{best.shard}", units=len(best.units),
            full=len(best.checkpointed) - len(best.selective), selective=len(best.selective),
            micro_batch=variant.micro_batch, grad_accum_steps=variant.grad_accum_steps,
            # a DDP plan reads the eager timeline (compiled DDP is not modelled)
            compiled=variant.facts.analysis.compiled is not None and best.strategy != "ddp")

    def _tokens(self, variant: Variant, c: Candidate) -> float:
        return variant.micro_batch * self.seq_len * variant.grad_accum_steps / max(
            c.time.step_s, 1e-12)


def _serves(evaluator: Evaluator | None, facts: ModelFacts, settings: SearchSettings) -> bool:
    """Whether ``evaluator`` evaluates ``facts`` under ``settings`` (budgets aside)."""
    if evaluator is None or evaluator.graph is not facts.graph or (
            evaluator.analysis is not facts.analysis):
        return False
    s = evaluator.settings
    return dataclasses.replace(s, budget_bytes=settings.budget_bytes,
                               headroom_bytes=settings.headroom_bytes) == settings


def compute_frontier(variants: list[Variant], settings: SearchSettings, *, seq_len: int,
                     count: int = 10, above_only: bool = False,
                     evaluator: Evaluator | None = None) -> Frontier:
    """The frontier around ``settings.budget_bytes`` ([Note: the frontier]): about ``count``
    round budgets over the whole range, or (``above_only``) from the user's budget up, which
    is all the report's "more memory" line needs. ``evaluator``: the planner's, whose caches
    and evaluated plans the frontier reuses for the variant it searched."""
    started, cpu_started = clock.perf_counter(), clock.process_time()
    user = settings.budget_bytes
    headroom = headroom_rule(user, settings.headroom_bytes)
    with cycle_collector_paused(promote_after=True):
        searcher = _Searcher(variants, settings, headroom, seq_len, evaluator)
        points = {user: searcher.point(user)}
        unlimited = searcher.ranked_at(UNLIMITED)
        plain = [c.memory.peak_bytes for _, c in unlimited if not c.checkpointed]
        top = searcher.point(UNLIMITED, unlimited)
        # the range ends where checkpointing is no longer needed (the fastest plan of all,
        # often far beyond any GPU, is reported in words)
        high = max(user, _budget_for(min(plain), headroom)) if plain else user
        notes = []
        if above_only:
            low = user
        else:
            at_zero = searcher.ranked_at(0)  # nothing fits: each plan at its smallest peak
            smallest = min([c.memory.peak_bytes for _, c in at_zero] + [searcher.smallest])
            low = _budget_for(smallest, headroom)
            points[low] = searcher.point(low)
        if high > user:
            points[high] = searcher.point(high)
        grid = [b for b in round_budgets(low, high, count) if b not in points]
        if above_only:
            for budget in grid:
                if _line_settled(points, user, high):
                    break  # [Note: the more-memory line's budgets]
                points[budget] = searcher.point(budget)
        else:
            points.update(searcher.points_beside(grid))
        if top.fits and _budget_for(top.peak_bytes, headroom) <= user:
            notes.append(f"the fastest plan of all fits the budget (its peak is "
                         f"{format_bytes(top.peak_bytes)})")
    return Frontier(points=[points[b] for b in sorted(points)], user_budget_bytes=user,
                    searches=searcher.searches, plans_evaluated=searcher.evaluations,
                    seconds=clock.perf_counter() - started,
                    cpu_seconds=clock.process_time() - cpu_started + searcher.cpu_elsewhere,
                    complete=not above_only, notes=notes)


def _line_settled(points: dict[int, FrontierPoint], user: int, high: int) -> bool:
    """Whether the budgets searched so far (``points``: the user's, ``high`` and the round
    budgets below the next) already give the more-memory line what every budget would.

    [Note: the more-memory line's budgets]
    The line names the first budget above the user's whose plan pays (``_first_paying``) and
    the best plan, the top budget's (``high``, the last that fits when it fits). Round budgets
    are searched in ascending order, so once one of them pays no higher one changes the
    first, and with ``high`` fitting none changes the best: the rest of the grid goes
    unsearched (70B on 64 GPUs: one of two searches, 68 of 302 evaluations). The page's
    frontier (not ``above_only``) searches every budget."""
    top = points.get(high)
    if top is None or not top.fits:
        return False
    ascending = [points[b] for b in sorted(points) if b != high]
    return _first_paying(ascending, points[user]) is not None


def describe_change(here: FrontierPoint, better: FrontierPoint) -> str:
    """``at 100.00 GB (93.13 GiB): no full checkpointing, 78 blocks selectively checkpointed
    instead of 57, -5.3% step`` (what the plan at ``better`` does differently from ``here``)."""
    what = []
    if better.compiled != here.compiled:
        what.append("compiled blocks" if better.compiled else "eager blocks")
    if better.full != here.full:
        what.append("no full checkpointing" if better.full == 0 else
                    f"{better.full} blocks fully checkpointed instead of {here.full}")
    if better.selective != here.selective:
        what.append("no selective checkpointing" if better.selective == 0 else
                    f"{better.selective} blocks selectively checkpointed instead of "
                    f"{here.selective}")
    if (better.strategy, better.mesh) != (here.strategy, here.mesh):
        what.append(f"{better.strategy} on mesh {better.mesh}")
    if better.units != here.units:
        what.append(f"{better.units} units")
    if better.micro_batch != here.micro_batch:
        what.append(f"micro-batch {better.micro_batch}")
    gain = (better.step_s / here.step_s - 1) if here.fits and here.step_s else 0.0
    return (f"at {format_bytes(better.budget_bytes)}: {', '.join(what) or better.name}"
            + (f", {gain:+.1%} step" if here.fits else f" (step {better.step_s:.4g} s)"))


def more_memory_line(frontier: Frontier) -> str:
    """The report's one line on what more memory buys, from the frontier."""
    here = frontier.at_user_budget
    better = frontier.more_memory()
    top = [p for p in frontier.points if p.fits][-1:] or [here]
    if better is None:
        return ("more memory: buys nothing here: "
                + (frontier.notes[0] if frontier.notes else
                   f"up to {format_bytes(top[0].budget_bytes)} the best plan stays within 1% "
                   "of this step"))
    line = "more memory: " + describe_change(here, better)
    best = top[0]
    if best.budget_bytes > better.budget_bytes and best.step_s < better.step_s * 0.99:
        line += f"; {describe_change(here, best)}"
    return line
