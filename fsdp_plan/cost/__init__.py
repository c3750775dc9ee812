"""Stage 3, analytic models, pure over facts: hardware, precision, units, collectives, memory and the step-time clock."""
