"""Shared test setup.

The plan verb reads and writes model facts in a cache on disk (facts/cache.py). Tests must not
depend on what earlier runs left there, nor write to the real home cache: the cache is off for
the whole suite (and for the CLI processes the tests start, which inherit the environment);
tests/test_facts_cache.py switches it on explicitly in a temporary folder.
"""

import os

os.environ["FSDP_PLAN_NO_CACHE"] = "1"
os.environ.pop("FSDP_PLAN_CACHE_DIR", None)
