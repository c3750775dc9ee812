"""``bench --refit HW.yaml``: correct a hardware file from a measured run, so the next plan
uses what this cluster really does.

[Note: refit]
The run measured, per phase, what the plan predicted (``predicted.phases_s``; the planner
writes it). Two factors come out of it, each the measured over the predicted time, clipped to
1/20..20:
- forward + backward: the measured step less its optimizer (the shares of the profiled step
  times the median step of forward, backward, the communication tail and the idle time,
  measure/profile.py ``PHASE_FIGURES``; the predicted backward runs to the tail's end and both
  predicted phases hold the host's time) over the predicted forward and backward; every
  compute rate and bus bandwidth of the file is divided by it, every overhead and latency
  multiplied. One factor for compute and communication together: the profiler's communication time includes the wait for the slowest
  peer (on a loaded CPU, most of it), so splitting them by the profile fitted noise;
- optimizer: the measured over the predicted optimizer phase; its per-parameter and
  per-tensor seconds are multiplied.
Times in the step model are sums and maxima of these, so a cluster uniformly slower than its
file is predicted exactly after one refit.
The file is rewritten atomically with its ``source`` saying what was refitted from what.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import atomic_write_all, check_writable
from fsdp_plan.cost.hardware import GPUS, Hardware, hardware_for, hardware_yaml, read_hardware_file

_CLIP = (0.05, 20.0)


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if not measured or not predicted or measured <= 0 or predicted <= 0:
        return None
    return min(_CLIP[1], max(_CLIP[0], measured / predicted))


def factors(result: dict[str, Any]) -> dict[str, float]:
    """The compute, communication and optimizer factors of [Note: refit] from a bench result."""
    st = result["step_time"]
    phases = st.get("phases") or {}
    measured, predicted = phases.get("measured") or {}, phases.get("predicted") or {}
    if not measured or not predicted or st.get("predicted_s") is None:
        raise BadInput("--refit needs the plan's predicted step time per phase "
                       "(predicted.phases_s), which this plan lacks: write it again with "
                       "fsdp-plan predict PLAN.yaml --hardware HW.yaml --format json, or re-plan.")
    step_ratio = _ratio(st["median_s"], st["predicted_s"]) or 1.0
    fw_bw = _ratio(sum(v for k, v in measured.items() if k != "optimizer"),
                   predicted.get("forward", 0.0) + predicted.get("backward", 0.0))
    optimizer = _ratio(measured.get("optimizer"), predicted.get("optimizer"))
    return {"compute": fw_bw or step_ratio, "communication": fw_bw or step_ratio,
            "optimizer": optimizer or step_ratio}


def scaled(hw: Hardware, f: dict[str, float]) -> Hardware:
    """``hw`` with its times multiplied by the factors (rates divided)."""
    c, m, o = f["compute"], f["communication"], f["optimizer"]
    return dataclasses.replace(
        hw,
        peak_flops=hw.peak_flops / c, hbm_bandwidth=hw.hbm_bandwidth / c,
        memory_bandwidth=(hw.memory_bandwidth or 0.8 * hw.hbm_bandwidth) / c,
        matmul_flops={d: {k: v / c for k, v in cls.items()} for d, cls in hw.matmul_flops.items()},
        attention_flops={d: v / c for d, v in hw.attention_flops.items()},
        op_overhead_s=hw.op_overhead_s * c, unit_overhead_s=hw.unit_overhead_s * c,
        fsdp_s_per_byte={k: {b: v * m for b, v in sizes.items()}
                         for k, sizes in hw.fsdp_s_per_byte.items()},
        intra_node_bandwidth=hw.intra_node_bandwidth / m,
        inter_node_bandwidth=hw.inter_node_bandwidth / m,
        collective_latency_s=hw.collective_latency_s * m,
        launch_overhead_s=hw.launch_overhead_s * m,
        collectives={k: {g: {"latency_s": fit.get("latency_s", hw.collective_latency_s) * m,
                             "bus_bandwidth": fit["bus_bandwidth"] / m}
                         for g, fit in groups.items()} for k, groups in hw.collectives.items()},
        optimizer_s_per_param={k: v * o for k, v in hw.optimizer_s_per_param.items()},
        optimizer_s_per_tensor={k: v * o for k, v in hw.optimizer_s_per_tensor.items()},
    )


def check_refit_path(path: str) -> None:
    """``--refit``: a .yaml path that can be written, holding a valid hardware file if it
    exists (``BadInput`` before any worker starts)."""
    if not path.endswith((".yaml", ".yml")):
        raise BadInput(f"--refit {path!r} must name a .yaml hardware file.")
    if os.path.exists(path):
        hardware_for("h100", read_hardware_file(path, "--refit"), where=f"--refit {path!r}")
    check_writable(path, "--refit")


def refit(path: str, gpu: str, result: dict[str, Any], start: Hardware | None = None
          ) -> tuple[Hardware, dict[str, float]]:
    """Rewrite the hardware file ``path`` (or, when it does not exist, write it from
    ``start``, the figures the plan stored, else the plan's ``gpu`` preset) from ``result``;
    returns the new hardware and the factors."""
    overrides = read_hardware_file(path, "--refit") if os.path.exists(path) else None
    base = gpu if gpu in GPUS else "h100"
    if overrides is None and start is not None:
        hw = start
    else:
        hw = hardware_for(base, overrides if overrides is not None else {},
                          where=f"--refit {path!r}")
    f = factors(result)
    new = dataclasses.replace(scaled(hw, f), source=(
        f"{hw.source or hw.name}; refit by fsdp-plan bench from {result.get('path', 'a run')} "
        f"(compute x{f['compute']:.3g}, communication x{f['communication']:.3g}, optimizer "
        f"x{f['optimizer']:.3g})"))
    atomic_write_all([(path, hardware_yaml(new, "Hardware file refitted by fsdp-plan bench "
                                                "--refit (SPEC section 6)."))])
    return new, f
