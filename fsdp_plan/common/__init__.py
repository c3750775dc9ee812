"""Ground floor: errors, limits, sizes, dtypes and file writing that every stage uses."""
