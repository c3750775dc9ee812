"""The analysis against PyTorch's own measurements on small real models on CPU."""

from __future__ import annotations

import os

import pytest
import torch
from layouts import evaluate
from torch.utils.flop_counter import FlopCounterMode

from fsdp_plan.facts.analysis import CPU_ATTENTION_FLOP_RULES, analyze
from fsdp_plan.facts.graph import build_module_graph
from fsdp_plan.model.load import ModelSource, load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {name: os.path.join(ROOT, "examples", f"{name}.py") for name in ("llama", "gpt2", "vit", "mixed")}


def loaded(name: str, batch: int = 2, seq: int = 32, **args):
    return load_model(ModelSource(source=EXAMPLES[name], args=args or {"size": "tiny"},
                                  batch_size=batch, seq_len=seq))


def real_model(lm):
    torch.manual_seed(0)
    return lm.factory(**lm.source.args)


@pytest.mark.parametrize("name", ["llama", "gpt2", "vit", "mixed"])
def test_parameter_counts_match_numel(name):
    lm = loaded(name)
    graph = build_module_graph(lm.model)
    assert graph.total_numel == sum(p.numel() for p in lm.model.parameters())


def test_gpt2_tied_weights_found():
    graph = build_module_graph(loaded("gpt2").model)
    assert ["lm_head", "wte"] in graph.tied_groups


def test_llama_blocks_are_the_layers():
    graph = build_module_graph(loaded("llama").model)
    assert graph.blocks == [f"layers.{i}" for i in range(4)]


@pytest.mark.parametrize("name", ["llama", "gpt2", "vit"])
def test_flops_match_flop_counter_on_real_tensors(name):
    lm = loaded(name)
    graph = build_module_graph(lm.model)
    analysis = analyze(lm, param_dtype=None, blocks=graph.blocks, with_checkpointing=False)
    model = real_model(lm)
    args, kwargs = lm.make_inputs(2, 32)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOP_RULES) as counter:
        lm.compute_loss(model(*args, **kwargs)).backward()
    total = analysis.total_fw_flops + analysis.total_bw_flops
    assert total == pytest.approx(counter.get_total_flops(), rel=1e-6)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_saved_activation_bytes_per_block_match_real_forward(name):
    """Bytes saved for backward inside each block: fake analysis vs saved-tensor hooks on real tensors."""
    lm = loaded(name, batch=2, seq=64)
    graph = build_module_graph(lm.model)
    analysis = analyze(lm, param_dtype=None, blocks=graph.blocks, with_checkpointing=False, exact=True)
    model = real_model(lm)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    hooks = [m.register_forward_pre_hook(lambda m, a: current.append(names[id(m)]))
             for m in model.modules()]
    hooks += [m.register_forward_hook(lambda m, a, o: current.pop() and None) for m in model.modules()]
    saved: dict[str, int] = {}
    seen: set[int] = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen and current:
            seen.add(ptr)
            saved[current[-1]] = saved.get(current[-1], 0) + t.untyped_storage().nbytes()
        return t

    args, kwargs = lm.make_inputs(2, 64)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
    for h in hooks:
        h.remove()
    del out
    # Attention is left out: on real CPU tensors SDPA may take the math path (keeping the
    # attention matrix) where fake tensors report the flash kernel a GPU uses (SPEC 5).
    def in_block(k: str, block: str) -> bool:
        return (k == block or k.startswith(block + ".")) and "att" not in k
    for block in graph.blocks:
        real = sum(v for k, v in saved.items() if in_block(k, block))
        fake = sum(c.saved_bytes for k, c in analysis.modules.items() if in_block(k, block))
        assert real > 0
        assert fake == pytest.approx(real, rel=0.05), block


def test_depth_reduction_matches_full_analysis():
    lm = loaded("llama", size="tiny", n_layers=7)
    graph = build_module_graph(lm.model)
    fast = analyze(lm, param_dtype=torch.bfloat16, blocks=graph.blocks, with_checkpointing=False)
    full = analyze(lm, param_dtype=torch.bfloat16, blocks=graph.blocks, with_checkpointing=False,
                   exact=True)
    assert [(e.kind, e.module, e.level, e.peak) for e in fast.timeline.events] == \
        [(e.kind, e.module, e.level, e.peak) for e in full.timeline.events]
    assert fast.total_fw_flops == full.total_fw_flops


def _unit_flops_add_up(lm) -> None:
    from fsdp_plan.cost.hardware import hardware_for
    from fsdp_plan.search.candidate import SearchSettings
    from fsdp_plan.search.evaluator import Evaluator
    from fsdp_plan.search.layouts import block_layouts
    graph = build_module_graph(lm.model)
    # bf16 as planned: grouped_mm experts (Mixtral) take bf16 operands only
    analysis = analyze(lm, param_dtype=torch.bfloat16, blocks=graph.blocks,
                       with_checkpointing=False)
    assert sum(c.own_fw_flops for c in analysis.modules.values()) == pytest.approx(
        analysis.total_fw_flops, rel=1e-9)
    ev = Evaluator(graph, analysis, SearchSettings(budget_bytes=10**12, headroom_bytes=0,
                                                   world_size=2, gpus_per_node=8,
                                                   hardware=hardware_for("h100")))
    for name, groups in block_layouts(graph).items():
        cand = evaluate(ev, name=name, strategy="full", replicate=1, shard=2, groups=groups,
                           reshard=[True] * len(groups), root_reshard=False,
                           forward_prefetch=0, backward_prefetch=1)
        fw = sum(ev.clock.flops(u)[0] for u in cand.units)
        bw = sum(ev.clock.flops(u)[1] for u in cand.units)
        assert fw == pytest.approx(analysis.total_fw_flops, rel=1e-9), name
        assert bw == pytest.approx(analysis.total_bw_flops, rel=1e-9), name


@pytest.mark.parametrize("name", ["llama", "gpt2", "vit", "mixed", "resnet"])
def test_unit_flops_add_up_to_the_models_flops(name):
    """Issue 12: every op counted in exactly one unit, for every layout the search tries."""
    path = os.path.join(ROOT, "examples", f"{name}.py")
    if not os.path.exists(path):
        pytest.skip(f"examples/{name}.py not bundled")
    _unit_flops_add_up(load_model(ModelSource(source=path, args={"size": "tiny"}, batch_size=2,
                                              seq_len=32)))


@pytest.mark.hf
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "vit", "bert", "mixtral"])
def test_unit_flops_add_up_on_hugging_face_models(name):
    """A Hugging Face decoder's blocks sit under ``model.layers`` inside ``LlamaModel``: the
    container never runs forward, which once counted every block again in its parent."""
    pytest.importorskip("transformers")
    path = os.path.join(ROOT, "examples", "hf", f"{name}.json")
    _unit_flops_add_up(load_model(ModelSource(source=path, kind="hf-config", batch_size=2,
                                              seq_len=16)))


def test_initialisers_are_skipped_only_while_building_on_meta(tmp_path):
    """The meta build skips torch.nn.init's writes (there are no values to write) and puts
    them back afterwards, also when the factory raises."""
    from torch.nn import init

    from fsdp_plan.common.errors import BadInput
    before = init.kaiming_uniform_
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "calls = []\n"
        "def build_model(fail=False):\n"
        "    m = nn.Linear(8, 4)\n"
        "    calls.append(nn.init.normal_(m.weight) is m.weight)\n"
        "    if fail:\n"
        "        raise ValueError('boom')\n"
        "    return m\n"
        "def example_inputs(batch_size, seq_len):\n"
        "    return (torch.randn(batch_size, 8),)\n")
    loaded = load_model(ModelSource(source=str(path)))
    assert loaded.model.weight.is_meta and tuple(loaded.model.weight.shape) == (4, 8)
    assert init.kaiming_uniform_ is before
    with pytest.raises(BadInput, match="boom"):
        load_model(ModelSource(source=str(path), args={"fail": True}))
    assert init.kaiming_uniform_ is before and init.normal_ is not None
    real = torch.empty(3)
    assert init.zeros_(real) is real and float(real.abs().sum()) == 0.0


def test_op_tensors_are_walked_in_pytree_order():
    """The meter walks an op's outputs and arguments without pytree ([Note: one dispatch mode
    per pass]): the same tensors, in ``tree_flatten``'s order, for every shape an op gives."""
    from collections import namedtuple

    from torch.utils._pytree import tree_flatten

    from fsdp_plan.facts.analysis import _tensors

    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    pair = namedtuple("pair", "x y")
    values = [a, (a, b), [a, None, 3, (b, [c])], ((a,), {"k": b, "j": [c, 2.0]}),
              {"out": (a, b)}, pair(a, b), torch.max(torch.ones(2, 3), dim=1),
              (torch.float32, torch.device("cpu"), "s", True), (), None, 1,
              ([a, b], {"x": pair(c, d), "y": None})]
    for value in values:
        expected = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        got = _tensors(value)
        assert len(got) == len(expected) and all(g is e for g, e in zip(got, expected)), value
