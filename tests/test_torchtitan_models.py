"""torchtitan's own models planned by name (issue 30 item 4): ``torchtitan:NAME:FLAVOR`` builds
torchtitan 0.3's model from its registry on ``meta``, FlexAttention analysed as causal SDPA
([Note: torchtitan attention under analysis] in fsdp_plan/model/torchtitan_models.py).

The plans name torchtitan's modules and, under ``--framework torchtitan``, have the units its
``apply_fsdp_to_decoder`` makes; ``verify`` measures the debug model's plan with FSDPMemTracker
on the fake process group (on the same SDPA-swapped model: FlexAttention has no backward on a
CPU, fake tensors included).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from test_measure_helpers import run_cli

from fsdp_plan.common.errors import BadInput
from fsdp_plan.export import torchtitan as titan_export
from fsdp_plan.export.common import plan_shape
from fsdp_plan.facts.graph import model_outline
from fsdp_plan.model.source import TORCHTITAN_ENTRY, torchtitan_shorthand
from fsdp_plan.plan.document import read_plan

pytestmark = pytest.mark.frameworks
pytest.importorskip("torchtitan")

from fsdp_plan.model import torchtitan_models

DEBUG = ["torchtitan:llama3:debugmodel", "--mem", "80GB", "--world-size", "8",
         "--seq-len", "512", "--batch-size", "2"]


def _units(plan_path: Path) -> list[list[str]]:
    return [u["modules"] for u in yaml.safe_load(plan_path.read_text())["units"]]


def test_the_shorthand_names_the_factory_and_refuses_a_bad_name() -> None:
    assert torchtitan_shorthand("torchtitan:llama3:8B") == {"name": "llama3", "flavor": "8B"}
    assert torchtitan_shorthand("examples/llama.py") is None
    with pytest.raises(BadInput, match="torchtitan:NAME:FLAVOR"):
        torchtitan_shorthand("torchtitan:llama3")


def test_build_model_is_torchtitans_model_with_sdpa_in_place_of_flex() -> None:
    """Same parameters and FQNs as torchtitan's registry builds; only the parameterless
    inner attention changes; ``seq_len`` sizes the RoPE caches as torchtitan's trainer does."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    with torch.device("meta"):
        theirs = model_registry("debugmodel").model.build()
        ours = torchtitan_models.build_model("llama3", "debugmodel", seq_len=512)
    assert ([(n, p.shape) for n, p in ours.named_parameters()]
            == [(n, p.shape) for n, p in theirs.named_parameters()])
    assert [n for n, _ in ours.named_children()] == ["tok_embeddings", "layers", "norm", "lm_head"]
    assert not any(isinstance(m, FlexAttention) for m in ours.modules())
    assert sum(isinstance(m, ScaledDotProductAttention) for m in ours.modules()) == 6
    assert sum(isinstance(m, FlexAttention) for m in theirs.modules()) == 6
    # torchtitan's flavour keeps 131,072 RoPE positions; its trainer cuts them to seq_len
    assert theirs.layers["0"].attention.rope.cache.shape[0] == 131072
    assert ours.layers["0"].attention.rope.cache.shape[0] == 512


def test_unknown_flavor_and_model_are_bad_input() -> None:
    with pytest.raises(BadInput, match="flavors are .*debugmodel"):
        torchtitan_models.build_model("llama3", "9B")
    with pytest.raises(BadInput, match="torchtitan has no model 'llama9'"):
        torchtitan_models.build_model("llama9", "debugmodel")
    code, _, err = run_cli(["torchtitan:llama3:9B", "--mem", "80GB"])
    assert code == 2 and "flavors are" in err and "Traceback" not in err
    with pytest.raises(BadInput, match="seq_len -5 sizes no RoPE cache"):  # from a plan file
        torchtitan_models.build_model("llama3", "debugmodel", seq_len=-5)


def test_a_varlen_attention_model_is_refused_with_what_to_do() -> None:
    """gpt_oss attends through VarlenAttention by default; planning it stopped with the
    model's own "attention_masks must be instance of VarlenMetadata" assertion. It is now
    refused before any pass, naming the backend and an alternative."""
    code, _, err = run_cli(["torchtitan:gpt_oss:debugmodel", "--mem", "80GB"])
    assert code == 2 and "VarlenAttention" in err and "--hf-config" in err, err
    assert "VarlenMetadata" not in err and "Traceback" not in err


def test_debugmodel_plans_with_torchtitans_units_and_verifies(tmp_path: Path) -> None:
    """The restricted plan is exactly torchtitan's layout ([norm, lm_head] one unit, root
    last), export needs no hook, and FSDPMemTracker on the fake process group measures the
    predicted peak."""
    plan_path = tmp_path / "plan.yaml"
    code, out, err = run_cli([*DEBUG, "--framework", "torchtitan", "--plan", str(plan_path)])
    assert code == 0, err
    assert "FlexAttention is analysed as its causal ScaledDotProductAttention" in err
    raw = yaml.safe_load(plan_path.read_text())
    assert raw["model"]["source"] == TORCHTITAN_ENTRY
    assert raw["model"]["args"] == {"name": "llama3", "flavor": "debugmodel", "seq_len": 512}
    assert _units(plan_path) == ([["tok_embeddings"]] + [[f"layers.{i}"] for i in range(6)]
                                 + [["norm", "lm_head"], [""]])
    plan = read_plan(str(plan_path))
    model = torchtitan_models.build_model(**raw["model"]["args"])
    shape = plan_shape(plan, model_outline(model))
    assert titan_export.config_gaps(shape) == []
    assert titan_export.reshard_policy(shape) in ("always", "default")

    # no MODEL: the plan names fsdp-plan's own torchtitan builder, which verify may import
    code, out, err = run_cli(["verify", str(plan_path), "--format", "json"])
    assert code == 0, err
    data = json.loads(out)
    predicted, measured = raw["predicted"]["peak_bytes"], data["measured_peak_bytes"]
    assert data["ok"]
    assert abs(measured - predicted) <= 0.01 * measured, (predicted, measured)


def test_debugmodel_unrestricted_plan_names_torchtitans_modules(tmp_path: Path) -> None:
    plan_path = tmp_path / "plan.yaml"
    code, _, err = run_cli([*DEBUG, "--plan", str(plan_path)])
    assert code == 0, err
    names = {"", "tok_embeddings", "norm", "lm_head", *(f"layers.{i}" for i in range(6))}
    assert {m for unit in _units(plan_path) for m in unit} <= names


def test_export_of_a_torchtitan_plan_starts_from_its_config_and_says_what_differs(
        tmp_path: Path) -> None:
    """No --torchtitan-config needed: BASE is torchtitan's config of the planned flavour, and
    the README states the attention analysed in flex's place, with its bytes."""
    plan_path = tmp_path / "plan.yaml"
    code, _, err = run_cli([*DEBUG, "--framework", "torchtitan", "--plan", str(plan_path)])
    assert code == 0, err
    out = tmp_path / "export"
    code, stdout, err = run_cli(["export", str(plan_path), TORCHTITAN_ENTRY, "-o", str(out)])
    assert code == 0, err
    assert "no code hook needed" in stdout
    module = (out / "fsdp_plan_torchtitan.py").read_text()
    assert "BASE = 'torchtitan.models.llama3.config_registry:llama3_debugmodel'" in module
    readme = (out / "README.md").read_text()
    assert "How the planned step differs from torchtitan's" in readme
    # max_scores: float32 [batch 2, 16 heads, 512] = 65,536 bytes a block, 6 blocks
    assert "max_scores, 65,536 bytes a block" in readme and "up to 393,216 bytes" in readme
    assert "Buffers:" not in readme  # the shorthand sized the RoPE caches to --seq-len
    assert "the run is the planned run" not in readme


@pytest.mark.slow
def test_llama3_8b_plans_with_torchtitans_35_units(tmp_path: Path) -> None:
    """The 8B flavour at batch 1 x 8192 on 8 GPUs, analysed on three blocks (the depth
    trick): torchtitan's 35 units, [norm, lm_head] one of them. (verify measured this plan's
    peak at 34,134,844,304 bytes, as predicted, in about 4 minutes on 2 cores; not run here.)"""
    plan_path = tmp_path / "plan.yaml"
    code, _, err = run_cli(["torchtitan:llama3:8B", "--mem", "80GB", "--world-size", "8",
                            "--seq-len", "8192", "--framework", "torchtitan",
                            "--plan", str(plan_path)])
    assert code == 0, err
    raw = yaml.safe_load(plan_path.read_text())
    assert raw["model"]["params"] == 8_030_261_248
    units = _units(plan_path)
    assert len(units) == 35
    assert units == ([["tok_embeddings"]] + [[f"layers.{i}"] for i in range(32)]
                     + [["norm", "lm_head"], [""]])
    assert raw["predicted"]["peak_bytes"] <= 72 * 10**9


def _saved(fn) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor autograd saves while ``fn()`` runs."""
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_flex_saves_what_the_sdpa_analysis_saves_plus_max_scores_and_block_tables() -> None:
    """The Note's claim, on fake CPU tensors at a GQA shape (32 query, 8 key/value heads):
    flex's higher-order op (called below flex_attention's CPU-backward refusal) and torchtitan's
    causal SDPA both save q, k, v at their head counts, the output and a float32 logsumexp;
    flex adds max_scores (float32 [batch, heads, seq]) and the BlockMask's int32 tables."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
    from torch.nn.attention.flex_attention import _identity, create_block_mask
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from fsdp_plan.model.fake import new_fake_mode
    batch, heads, kv_heads, seq, dim = 1, 32, 8, 512, 128
    with new_fake_mode():
        q = torch.randn(batch, heads, seq, dim, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, kv_heads, seq, dim, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(batch, kv_heads, seq, dim, dtype=torch.bfloat16, requires_grad=True)
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, batch, None, seq, seq,
                                 device="cpu")
        flex = _saved(lambda: flex_hop(q, k, v, _identity, mask.as_tuple(), dim ** -0.5,
                                       {"BACKEND": "AUTO"}))
        sdpa_module = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        # torchtitan's modules take (batch, seq, heads, head_dim)
        sdpa = _saved(lambda: sdpa_module(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), enable_gqa=True))
    lse = ((batch, heads, seq), torch.float32)
    common = [((batch, heads, seq, dim), torch.bfloat16), ((batch, kv_heads, seq, dim),
              torch.bfloat16), ((batch, kv_heads, seq, dim), torch.bfloat16),
              ((batch, heads, seq, dim), torch.bfloat16), lse]
    assert sorted(sdpa, key=str) == sorted(common, key=str)
    tables = [s for s in flex if s[1] == torch.int32]
    assert sorted([s for s in flex if s[1] != torch.int32], key=str) == sorted(common + [lse],
                                                                              key=str)
    blocks = seq // 128
    assert tables and all(s in (((batch, 1, blocks), torch.int32),
                                ((batch, 1, blocks, blocks), torch.int32)) for s in tables)


@pytest.mark.slow
def test_tied_llama3_1b_has_torchtitans_one_unit_for_embedding_norm_and_head(
        tmp_path: Path) -> None:
    """The 1B flavour ties tok_embeddings to lm_head (enable_weight_tying); torchtitan then
    shards [tok_embeddings, norm, lm_head] as one unit kept gathered under its default
    policy. Before, the tied weight split torchtitan's two units and nothing was restricted."""
    plan_path = tmp_path / "plan.yaml"
    code, out, err = run_cli(["torchtitan:llama3:1B", "--mem", "80GB", "--world-size", "8",
                              "--seq-len", "512", "--batch-size", "2", "--framework",
                              "torchtitan", "--plan", str(plan_path)])
    assert code == 0, err
    assert "restricted to torchtitan's configuration" in out
    assert _units(plan_path) == ([["tok_embeddings", "norm", "lm_head"]]
                                 + [[f"layers.{i}"] for i in range(16)] + [[""]])
    raw = yaml.safe_load(plan_path.read_text())
    model = torchtitan_models.build_model(**raw["model"]["args"])
    shape = plan_shape(read_plan(str(plan_path)), model_outline(model))
    assert titan_export.config_gaps(shape) == []
    assert titan_export.reshard_policy(shape) in ("always", "default", "never")
