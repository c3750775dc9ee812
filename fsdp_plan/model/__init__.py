"""Stage 1, the user's model on meta: where it comes from (source.py, torch-free), loading it (load.py, hf.py) and fake tensors (fake.py)."""
