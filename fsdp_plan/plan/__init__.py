"""Stage 5, the plan document and what is made from it: reading and checking it, building it from a candidate, the policy module, the report."""
