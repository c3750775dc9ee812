"""Stage 4, one search over layouts: strategies are handed to it; the micro-batch sweep wraps it."""
