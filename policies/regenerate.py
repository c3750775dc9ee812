"""Regenerate the bundled examples' policies at typical budgets (one command, deterministic).

    python policies/regenerate.py          # rewrites policies/*.py and policies/*.yaml
    python policies/regenerate.py --check  # exit 1 if any file differs from what the planner writes now

Each entry is the exact ``fsdp-plan`` command line a user would type.
"""

from __future__ import annotations

import filecmp
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

POLICIES: dict[str, list[str]] = {
    "llama8b_h100x8": ["examples/llama.py", "--model-arg", "size=8b", "--mem", "80GB",
                       "--world-size", "8", "--seq-len", "4096"],
    "llama70b_h100x64": ["examples/llama.py", "--model-arg", "size=70b", "--mem", "80GB",
                         "--world-size", "64", "--seq-len", "4096"],
    "llama405b_h100x512": ["examples/llama.py", "--model-arg", "size=405b", "--mem", "80GB",
                           "--world-size", "512", "--seq-len", "4096"],
    "gpt2xl_a100x8": ["examples/gpt2.py", "--model-arg", "size=xl", "--mem", "40GB",
                      "--world-size", "8", "--seq-len", "1024", "--batch-size", "8", "--gpu", "a100"],
    "vit_huge_h100x16": ["examples/vit.py", "--model-arg", "size=huge", "--mem", "80GB",
                         "--world-size", "16", "--gpus-per-node", "8", "--batch-size", "64"],
}


def write_all(folder: str) -> None:
    from fsdp_plan.cli.main import main
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for name, argv in POLICIES.items():
            code = main([*argv, "--format", "json", "-o", os.path.join(folder, f"{name}.py"),
                         "--plan", os.path.join(folder, f"{name}.yaml")])
            if code != 0:
                raise SystemExit(f"planning {name} failed with exit code {code}")
    finally:
        os.chdir(cwd)


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
            try:
                write_all(tmp)
            finally:
                sys.stdout = stdout
            stale = [f for name in POLICIES for f in (f"{name}.py", f"{name}.yaml")
                     if not os.path.exists(os.path.join(HERE, f))
                     or not filecmp.cmp(os.path.join(tmp, f), os.path.join(HERE, f), shallow=False)]
        if stale:
            print("stale policies (run python policies/regenerate.py):", ", ".join(stale))
            return 1
        print("policies are current")
        return 0
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
    try:
        write_all(HERE)
    finally:
        sys.stdout = stdout
    print("wrote", ", ".join(POLICIES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
