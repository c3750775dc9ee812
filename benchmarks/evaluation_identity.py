"""Every evaluation the planner makes, written down exactly, to show a speed change kept
every prediction (issue 29: "predictions identical to today's").

    python benchmarks/evaluation_identity.py OUT_DIR           # write the record
    diff -r -x "*.stderr" BEFORE_DIR AFTER_DIR                 # nothing may differ

Give both runs the same ``PYTHONHASHSEED`` (any), and run one side again under another: the
record must not depend on it either. Python seeds string hashing per process, and a sum over a
set of names once depended on it (a unit's recompute, cost/unit_time.py ``ordered_costs``:
GPT-2 xl's search at 16 GB ranked the same plans with other last digits in 1 run of 8).

Each case is a planning command run in a fresh process (``fsdp_plan.cli.main.main``, with the
facts cache of ``$FSDP_PLAN_CACHE_DIR``), with ``Evaluator._evaluate`` wrapped to write one line
per evaluation: the layout's name and the ``repr`` of the whole candidate (peak and memory
categories, every field of the step time, collectives, fits, units, block modes, detail;
``repr`` of a float round-trips, so equal lines mean equal numbers), written when the command
has ended: a step time the command never read is computed then, the others when the command
first read them ([Note: step times when asked] in fsdp_plan/common/deferred.py), and the line
reads as it did before times were deferred. The report on stdout, the plan YAML and the policy
module are kept beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = "examples/llama.py"
CASES = {
    "llama70b_64": [LLAMA, "--model-arg", "size=70b", "--mem", "80GB", "--world-size", "64"],
    "llama405b_512": [LLAMA, "--model-arg", "size=405b", "--mem", "80GB", "--world-size", "512"],
    "llama8b_8_tight": [LLAMA, "--model-arg", "size=8b", "--mem", "24GB", "--world-size", "8"],
    "llama8b_16_overlap": [LLAMA, "--model-arg", "size=8b", "--mem", "40GB", "--world-size",
                           "16", "--optimizer-overlap", "--gpu", "h200"],
    "llama8b_offload": [LLAMA, "--model-arg", "size=8b", "--mem", "12GB", "--world-size", "2",
                        "--allow-offload"],
    "llama70b_global_batch": [LLAMA, "--model-arg", "size=70b", "--mem", "80GB",
                              "--world-size", "128", "--global-batch-size", "256",
                              "--seq-len", "2048"],
    "gpt2_ddp": ["examples/gpt2.py", "--model-arg", "size=small", "--seq-len", "1024",
                 "--mem", "80GB", "--world-size", "16",
                 "--allow-lossy-hooks", "--reduce-dtype", "auto"],
    "vit_4": ["examples/vit.py", "--mem", "16GB", "--world-size", "4"],
    "mixed_8": ["examples/mixed.py", "--mem", "8GB", "--world-size", "8"],
    "deep_narrow": ["examples/deep_narrow.py", "--mem", "4GB", "--world-size", "8",
                    "--strategy", "hybrid", "--gpus-per-node", "4"],
    "llama70b_compile": [LLAMA, "--model-arg", "size=70b", "--mem", "80GB", "--world-size",
                         "64", "--compile"],
}

_CHILD = """
import sys
from fsdp_plan.search.evaluator import Evaluator
evaluated = []
inner = Evaluator._evaluate
def recorded(self, layout, name):
    candidate = inner(self, layout, name)
    evaluated.append((name, candidate))
    return candidate
Evaluator._evaluate = recorded
from fsdp_plan.cli.main import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as out:  # after the command: its step times computed when asked
    for name, candidate in evaluated:
        time = repr(candidate.time)  # the rest now ([Note: step times when asked])
        line = repr(candidate).replace(f"deferred_time=Deferred({time})", f"time={time}", 1)
        out.write(f"{name}\\t{line}\\n")
print(f"exit {code}")
"""


def record(out_dir: str, names: list[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        argv = [*CASES[name], "--plan", os.path.join(out_dir, f"{name}.yaml"),
                "-o", os.path.join(out_dir, f"{name}_policy.py")]
        done = subprocess.run([sys.executable, "-c", _CHILD,
                               os.path.join(out_dir, f"{name}.evaluations"), *argv],
                              capture_output=True, text=True, cwd=ROOT, check=False)
        with open(os.path.join(out_dir, f"{name}.report"), "w") as f:
            # the "planned in" line holds a wall time: the only line allowed to differ
            f.write("".join(line + "\n" for line in done.stdout.splitlines()
                            if "planned in" not in line))
        with open(os.path.join(out_dir, f"{name}.stderr"), "w") as f:  # paths, cache notes
            f.write(done.stderr)
        with open(os.path.join(out_dir, f"{name}.evaluations")) as f:
            lines = sum(1 for _ in f)
        print(f"{name}: {done.stdout.splitlines()[-1] if done.stdout else '?'}, "
              f"{lines} evaluations", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    record(sys.argv[1], sys.argv[2:] or list(CASES))
