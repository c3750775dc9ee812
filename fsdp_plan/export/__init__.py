"""Framework files made from a plan: the stage after the policy module (plan -> emit -> export).

``fsdp-plan export PLAN.yaml --to accelerate|trainer|lightning|torchtitan -o DIR`` writes a
framework's own configuration, the policy module, the shortest code hook that keeps what the
configuration cannot say, and a README saying how to launch and what, if anything, is lost.

- ``common``: what a plan asks of a framework (``PlanShape``), what a configuration cannot
  say (``Gap``), and the written result (``Export``); ``--framework`` planning reuses the gaps.
- one module per framework (``accelerate``, ``trainer``, ``lightning``, ``torchtitan``), each
  with ``config_gaps(shape)`` and ``render(plan, shape, options)``.

Nothing here imports a framework: the files are text, and the frameworks' own readers check
them in the tests (pytest marker ``frameworks``).
"""

from __future__ import annotations

from fsdp_plan.export.common import FRAMEWORKS, Export, Gap, PlanShape, export_plan, plan_shape

__all__ = ["FRAMEWORKS", "Export", "Gap", "PlanShape", "export_plan", "plan_shape"]
