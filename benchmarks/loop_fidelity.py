"""The loops users run (issue 18): HF losses, autocast, torchtitan's op policy, nn.Transformer.

    python benchmarks/loop_fidelity.py [--quick] [--only SECTION ...] [--out FILE]

Every figure is a prediction held against PyTorch's own measurement on this CPU:
- ``hf-loss``: ``--hf-config`` models trained with their labels (Llama-3-8B at world 8,
  2 x 4096; T5-base; ViT-base image classification), planned, then FSDPMemTracker on the fake
  process group at the plan's world size runs the same model with the same labels.
- ``autocast``: ``--autocast bf16`` FSDP plans over two micro-batches (ResNet-50 with batch
  norm at batch 64, the HF Llama-3-8B config, T5-base) against FSDPMemTracker; DDP plans (bf16
  param dtype, so autocast) against MemTracker on a real one-rank gloo run (a DDP rank holds
  the whole model at any world size): ResNet-50 at batch 64 (64 px images: a real CPU step at
  224 px outlasts the worker's progress timeout), a small HF Llama, a small T5;
  and the collectives of small autocast and DDP plans on 2 gloo processes against the plan.
- ``op-policy``: the "torchtitan selective-op AC" recipe row (every second matmul saved) on the
  Llama 3 8B shape (world 8, 1 x 4096) against FSDPMemTracker running torchtitan's op policy
  written as torchtitan writes it.
- ``transformer``: ``examples/seq2seq_transformer.py`` (nn.Transformer, float causal mask) and
  ``examples/encoder_classifier.py`` (nn.TransformerEncoder, key padding mask): planned at
  world 4, FSDPMemTracker, and ``fsdp-plan bench`` on 2 gloo processes (counts exact).
``--quick`` runs every section at small shapes (a few minutes); the full run takes about an
hour on 2 busy cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from fsdp_plan.api import PlanRequest, make_plan, to_plan
from fsdp_plan.common.errors import FsdpPlanError
from fsdp_plan.measure.collectives import count_collectives_many
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.measure.peak import measured_peak
from fsdp_plan.model.load import load_model
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import write_plan
from fsdp_plan.plan.emit import load_policy_module
from tests.fixtures.torchtitan_op_policy import (
    torchtitan_policy_module,  # torchtitan's AC, verbatim
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
HF = os.path.join(EXAMPLES, "hf")
GB = 10**9
AUTOCAST = {"autocast_dtype": "bfloat16", "param_dtype": "float32"}


@dataclass
class Row:
    section: str
    case: str
    predicted: int | None
    measured: int | None
    note: str = ""
    seconds: float = 0.0

    @property
    def error(self) -> float | None:
        if not self.predicted or not self.measured:
            return None
        return (self.predicted - self.measured) / self.measured


def hf(name: str, batch: int, seq: int) -> ModelSource:
    return ModelSource(source=os.path.join(HF, f"{name}.json"), kind="hf-config",
                       entry="from_config", batch_size=batch, seq_len=seq)


def example(name: str, batch: int, seq: int, **args) -> ModelSource:
    return ModelSource(source=os.path.join(EXAMPLES, f"{name}.py"), args=args,
                       batch_size=batch, seq_len=seq)


def planned_and_measured(section: str, case: str, source: ModelSource, **request) -> Row:
    """Plan with the library API, then measure the chosen plan as ``verify`` does."""
    started = time.perf_counter()
    try:
        result = make_plan(PlanRequest(source=source, **request))
    except FsdpPlanError as e:  # a case that does not plan is a row that says why
        return Row(section, case, None, None, f"exit {e.exit_code}: {e}"[:300])
    plan = result.plan
    measured = measured_peak(result.loaded, plan, load_policy_module(result.policy_source()))
    units = len(plan.units)
    ac = plan.activation_checkpointing
    note = (f"{plan.strategy}, {units} unit(s), {len(ac)} checkpointed, "
            f"{plan.grad_accum_steps} micro-batch(es), peak at {plan.predicted['peak_phase']}")
    loss = plan.predicted["breakdown"].get("loss")
    if loss:
        note += f", loss holds {_size(loss)} there"
    return Row(section, case, plan.predicted["peak_bytes"], measured.peak_bytes, note,
               time.perf_counter() - started)


# --- hf-loss ----------------------------------------------------------------------------------

def hf_loss(quick: bool) -> list[Row]:
    if quick:
        cases = [("llama (tiny config)", hf("llama", 2, 128), "3MB", 8),
                 ("t5 (tiny config)", hf("t5", 2, 64), "6MB", 8),
                 ("vit (tiny config)", hf("vit", 8, 1), "3MB", 8)]
    else:
        cases = [("Llama-3-8B world 8, 2 x 4096", hf("llama3_8b", 2, 4096), "80GB", 8),
                 ("T5-base world 8, 8 x 512", hf("t5_base", 8, 512), "4GB", 8),
                 ("ViT-base/16 classification world 8, batch 64", hf("vit_base", 64, 1), "2GB",
                  8)]
    from fsdp_plan.common.sizes import parse_bytes
    return [planned_and_measured("hf-loss", name, source, budget_bytes=parse_bytes(mem),
                                 world_size=world)
            for name, source, mem, world in cases]


# --- autocast ---------------------------------------------------------------------------------

def autocast(quick: bool) -> list[Row]:
    resnet = example("resnet", 64, 1, size="tiny" if quick else "resnet50")
    if quick:
        fsdp = [("ResNet tiny, batch 64", resnet, 40 * 10**6, 4),
                ("HF Llama (tiny config)", hf("llama", 2, 128), 4 * 10**6, 4),
                ("T5 (tiny config)", hf("t5", 2, 64), 6 * 10**6, 4)]
    else:
        fsdp = [("ResNet-50, batch 64, world 8", resnet, 6 * GB, 8),
                ("HF Llama-3-8B, world 8, 1 x 4096", hf("llama3_8b", 1, 4096), 80 * GB, 8),
                ("T5-base, world 8, 8 x 512", hf("t5_base", 8, 512), 6 * GB, 8)]
    rows = [planned_and_measured("autocast", f"FSDP --autocast bf16: {name}, 2 micro-batches",
                                 source, budget_bytes=mem, world_size=world, strategy="full",
                                 grad_accum_steps=2, **AUTOCAST)
            for name, source, mem, world in fsdp]
    # a real CPU step of ResNet-50 at 224 px takes minutes on one thread: 64 px images here
    ddp_resnet = example("resnet", 64, 1, size="tiny") if quick else example(
        "resnet", 64, 1, size="resnet50", img_size=64)
    ddp = [(("ResNet tiny" if quick else "ResNet-50 (64 px images)") + ", batch 64", ddp_resnet),
           ("HF Llama (tiny config), 2 x 256", hf("llama", 2, 256)),
           ("T5 (tiny config), 2 x 128", hf("t5", 2, 128))]
    rows += [planned_and_measured("autocast", f"DDP bf16 (autocast): {name}", source,
                                  budget_bytes=40 * GB, world_size=8, strategy="ddp")
             for name, source in ddp]
    rows.append(gloo_counts())
    return rows


def gloo_counts() -> Row:
    """Collectives of small autocast and DDP plans on 2 gloo processes: equal or not."""
    started = time.perf_counter()
    cases = [(example("llama", 1, 64, size="tiny"),
              {"strategy": "full", "budget_bytes": 3_200_000, "world_size": 4,
               "grad_accum_steps": 2, **AUTOCAST}),
             (example("resnet", 64, 1, size="tiny"),
              {"strategy": "full", "budget_bytes": 40 * 10**6, "world_size": 4, **AUTOCAST}),
             (example("resnet", 64, 1, size="tiny"),
              {"strategy": "ddp", "budget_bytes": GB, "world_size": 2}),
             (hf("t5", 2, 64), {"strategy": "ddp", "budget_bytes": GB, "world_size": 2})]
    plans = [(source, make_plan(PlanRequest(source=source, **kw)).plan) for source, kw in cases]
    jobs = [{"plan": p.to_dict(), "fsdp_version": 2, "source": s} for s, p in plans]
    counted = count_collectives_many(plans[0][0], jobs, nproc=2, timeout_s=900)
    exact = sum(per_rank[0] == per_rank[1] == p.predicted["collectives_per_step"]
                for (_, p), per_rank in zip(plans, counted))
    return Row("autocast", "gloo counts, 2 processes (tiny Llama FSDP x2 micro-batches, ResNet "
               "FSDP, ResNet DDP, T5 DDP)", None, None,
               f"{exact}/{len(plans)} plans counted exactly as predicted",
               time.perf_counter() - started)


# --- op-policy: torchtitan's op policy (tests/fixtures/torchtitan_op_policy.py) ------------

def op_policy(quick: bool) -> list[Row]:
    started = time.perf_counter()
    source = (example("llama", 2, 128, size="small") if quick
              else example("llama", 1, 4096, size="8b"))
    world = 4 if quick else 8
    request = PlanRequest(source=source, budget_bytes=1000 * GB, world_size=world)
    result = make_plan(request)
    recipe = next(r for r in result.recipes if r.name == "recipe: torchtitan selective-op AC")
    plan = to_plan(recipe, request, result.facts)
    measured = measure_peak(load_model(source), plan, torchtitan_policy_module(plan))
    shape = "Llama small, world 4, 2 x 128" if quick else "Llama 3 8B, world 8, 1 x 4096"
    return [Row("op-policy", f"torchtitan selective-op recipe (stride {plan.selective_mm_stride})"
                f": {shape}", recipe.memory.peak_bytes, measured.peak_bytes,
                "measured: FSDPMemTracker running torchtitan's _get_custom_policy",
                time.perf_counter() - started)]


# --- transformer ------------------------------------------------------------------------------

def transformer(quick: bool) -> list[Row]:
    del quick  # small shapes either way: the real gloo bench runs them
    rows = []
    for name, mem in (("seq2seq_transformer", 3 * 10**6), ("encoder_classifier", 10**6)):
        source = example(name, 2, 64)
        started = time.perf_counter()
        result = make_plan(PlanRequest(source=source, budget_bytes=mem, world_size=4,
                                       strategy="full"))
        measured = measure_peak(result.loaded, result.plan,
                                load_policy_module(result.policy_source()))
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "plan.yaml")
            write_plan(result.plan, path)
            bench = subprocess.run(
                [sys.executable, "-m", "fsdp_plan.cli.main", "bench", path, source.source,
                 "--nproc", "2", "--steps", "2", "--warmup", "1", "--out",
                 os.path.join(folder, "out"), "--format", "json"],
                capture_output=True, text=True, timeout=1800, check=False,
                env={**os.environ, "PYTHONPATH": ROOT})
        counts = "counts exact" if bench.returncode == 0 else (
            f"bench exit {bench.returncode}: {bench.stderr.strip().splitlines()[-1:]}")
        case = f"{name} (world 4, 2 x 64, {len(result.plan.units)} units)"
        rows.append(Row("transformer", case, result.plan.predicted["peak_bytes"],
                        measured.peak_bytes,
                        f"fsdp-plan bench --nproc 2: {counts}", time.perf_counter() - started))
    return rows


SECTIONS = {"hf-loss": hf_loss, "autocast": autocast, "op-policy": op_policy,
            "transformer": transformer}


def _size(nbytes: int | None) -> str:
    if not nbytes:
        return "-"
    return f"{nbytes / GB:.3f} GB" if nbytes >= GB else f"{nbytes / 10**6:.3f} MB"


def report(rows: list[Row]) -> str:
    header = (f"{'section':<11} {'case':<78} {'predicted':>11} {'measured':>11} {'error':>7}"
              f" {'s':>5}  note")
    lines = [header]
    for r in rows:
        pred, meas = _size(r.predicted), _size(r.measured)
        err = f"{r.error:+.2%}" if r.error is not None else "-"
        lines.append(f"{r.section:<11} {r.case:<78} {pred:>11} {meas:>11} {err:>7} "
                     f"{r.seconds:>5.0f}  {r.note}")
    errors = [r.error for r in rows if r.error is not None]
    if errors:
        lines.append("")
        lines.append(f"{len(errors)} memory figures: worst {max(errors, key=abs):+.2%}, all "
                     f"within 3%: {'yes' if all(abs(e) <= 0.03 for e in errors) else 'no'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a few minutes)")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), default=None)
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    rows: list[Row] = []
    for name in args.only or list(SECTIONS):
        for row in SECTIONS[name](args.quick):
            rows.append(row)
            print(json.dumps(dataclasses.asdict(row)), file=sys.stderr, flush=True)
    text = report(rows)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
