"""Stage 2, what the planner knows about a model: plain-data facts (types.py) made by one fake forward+backward (analysis.py, graph.py, depth.py)."""
