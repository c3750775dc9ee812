"""Write the policy module of a plan file (tuned, hand-edited or planned), as planning would.

    fsdp-plan emit PLAN.yaml -o POLICY.py

The plan is validated as ``predict`` validates it (exit 2 for an invalid plan, nothing
written); the module is byte-identical to the one ``fsdp-plan MODEL ... -o POLICY.py`` writes
for the same plan, so ``tune``'s best plan or a plan edited by hand becomes a policy without
planning again. No model is loaded: the policy is made from the plan alone.
"""

from __future__ import annotations

import argparse

from fsdp_plan.common.files import check_outputs, check_writable
from fsdp_plan.plan.document import read_plan
from fsdp_plan.plan.emit import write_policy_module
from fsdp_plan.plan.read import plan_input_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.yaml", help="a plan file, written by fsdp-plan, "
                        "tune or by hand (SPEC section 3)")
    parser.add_argument("-o", "--output", required=True, metavar="POLICY.py",
                        help="where to write the policy module (written whole or not at all)")


def run(args: argparse.Namespace) -> int:
    plan = read_plan(args.plan)  # data only: its model.source is an input too (S4-02)
    check_outputs(plan_input_files(plan, args.plan), [("-o", args.output)])
    check_writable(args.output, "-o")
    write_policy_module(plan, args.output)
    print(f"wrote {args.output} (strategy {plan.strategy}, {len(plan.units)} units)")
    return 0
