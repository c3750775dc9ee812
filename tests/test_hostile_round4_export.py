"""Hostile input, round 4 (issue 31): the export and output-path defects, replayed.

Each refusal asserts the SPEC 2 contract (``cli_checks.refused``: the exit code, one paragraph
naming the problem, no traceback, nothing on stdout) and that no file was written or changed.
Each injection exports a plan whose every string field holds the payload (the model file's
class names and module FQNs too), then imports every generated ``.py`` in a fresh process and
finds no side effect, loads every YAML and JSON to the intended values, and renders the README
to the same HTML structure as a harmless export's.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import cli_checks
import pytest
import yaml
from test_hostile_round3 import tree
from test_measure_helpers import run_cli

from fsdp_plan.plan.document import Mesh, Plan, Unit, write_plan

FRAMEWORKS = ("accelerate", "trainer", "lightning", "torchtitan")

# The reproductions of S4-01, then one string holding what breaks Markdown, YAML and a
# terminal (each payload that runs leaves a PWN_* file in the working folder).
PAYLOADS = {
    "docstring-statement": 'x"""\nopen("PWN_TQ","w")\n"""',
    "unparsable": 'a"""b',
    "markup": ("q'''\\\n```\n<script>alert(1)</script>\n# heading\n[l](javascript:x) *e* _u_ "
               "`c` | t | ~~s~~ &amp; \x1b[31m\u2028- item: {a: *b} !!python/object "
               "open('PWN_MD','w')"),
}

MODEL = '''\
# a tiny model whose class names and module names hold NAME (written by the test)
from torch import nn

NAME = {name!r}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


Block.__name__ = Block.__qualname__ = NAME + " Block"
Norm = type(NAME + "Norm", (nn.LayerNorm,), {{}})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({{key: Block() for key in {keys!r}}})
        self.add_module({norm!r}, Norm(8))

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return getattr(self, {norm!r})(x)


def build_model(**_args):
    return Net()


def example_inputs(batch_size, seq_len):
    import torch
    return (torch.randn(batch_size, seq_len, 8),)
'''


def _fqn_part(name: str, suffix: str) -> str:
    return name.replace(".", "_") + suffix  # a child's name cannot hold a dot


def hostile_export(tmp_path: Path, name: str) -> tuple[Path, Plan, dict[str, Path], dict]:
    """A model file and a plan carrying ``name`` in every string the plan validator lets
    through, exported to every framework; returns (model file, plan, {framework: folder},
    {framework: stdout})."""
    keys = [_fqn_part(name, "0"), _fqn_part(name, "1")]
    norm = _fqn_part(name, "norm")
    model = tmp_path / "model.py"
    model.write_text(MODEL.format(name=name, keys=keys, norm=norm))
    layers = [f"layers.{key}" for key in keys]
    plan = Plan(model={"source": name, "entry": "build_model", "kind": "file",
                       "args": {"note": name, "items": [name, 1], "nested": {name: name}},
                       "batch_size": 2, "seq_len": 8, "notes": [name]},
                budget_bytes=10**9, world_size=2, mesh=Mesh(replicate=1, shard=2),
                units=[Unit(modules=[layers[0]]),
                       Unit(modules=[layers[1]], reshard_after_forward=False),
                       Unit(modules=[""], reshard_after_forward=False)],
                activation_checkpointing=[layers[1]],
                forward_prefetch={layers[0]: [layers[1]]},
                backward_prefetch={layers[1]: [layers[0]]},
                mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                gpu=name,
                # a hardware name is one printable line (hardware_for): the rest goes as is
                hardware={"file": name, "header": name,
                          "figures": {"name": "".join(c for c in name if c.isprintable())}})
    plan_path = tmp_path / "plan.yaml"
    write_plan(plan, str(plan_path))
    (tmp_path / "titan_stub.py").write_text(
        "from types import SimpleNamespace as NS\n\n\ndef make():\n"
        "    return NS(training=NS(), parallelism=NS(), activation_checkpoint=None,\n"
        "              model_spec=NS())\n")
    folders, stdout = {}, {}
    for framework in FRAMEWORKS:
        out = tmp_path / framework
        extra = ["--torchtitan-config", "titan_stub:make"] if framework == "torchtitan" else []
        code, printed, err = run_cli(["export", str(plan_path), str(model), "--to", framework,
                                      "-o", str(out), *extra])
        assert code == 0, err
        folders[framework], stdout[framework] = out, printed
    return model, plan, folders, stdout


IMPORT_ALL = r'''
import importlib, json, os, sys
report = {}
for folder in json.loads(sys.argv[1]):
    sys.path.insert(0, folder)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            module = importlib.import_module(name[:-3])
            if name == "fsdp_plan_policy.py":
                report[folder] = module.PLAN
            if name == "fsdp_plan_torchtitan.py":
                config = module.fsdp_plan()
                report["titan"] = {"batch": config.training.local_batch_size,
                                   "shard": config.parallelism.data_parallel_shard_degree}
    for name in [n for n in sys.modules if n.startswith("fsdp_plan_")]:
        del sys.modules[name]
    sys.path.remove(folder)
print(json.dumps(report))
'''


def _html_tags(markdown: str) -> list[str]:
    from markdown_it import MarkdownIt

    html = MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)
    return re.findall(r"<(/?[a-zA-Z][a-zA-Z0-9]*)", html)


@pytest.fixture(scope="module")
def benign(tmp_path_factory):
    """The same export with a harmless name (a class name with a space, as the hostile one
    has, so both meet the same gaps)."""
    return hostile_export(tmp_path_factory.mktemp("benign"), "benign")


@pytest.mark.frameworks  # the generated modules import accelerate, lightning, transformers
@pytest.mark.hf
@pytest.mark.parametrize("payload", list(PAYLOADS), ids=list(PAYLOADS))
def test_every_plan_string_is_encoded_for_where_it_lands_in_every_export(tmp_path, benign,
                                                                         payload):
    """S4-01: imported in a fresh process, no generated module runs the payload; each parses,
    the policy holds the plan exactly, the configs load to the values the exporters meant, and
    the READMEs have the harmless export's Markdown structure."""
    name = PAYLOADS[payload]
    model, plan, folders, stdout = hostile_export(tmp_path, name)
    for out in folders.values():
        for file in out.iterdir():
            if file.suffix == ".py":
                ast.parse(file.read_text(), str(file))
    run_in = tmp_path / "run"
    run_in.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL,
                           json.dumps([str(p) for p in folders.values()])],
                          cwd=run_in, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert os.listdir(run_in) == [], "a generated module wrote a file when imported"
    assert not [f for _, _, files in os.walk(tmp_path) for f in files if "PWN" in f]
    for out in folders.values():
        assert report[str(out)] == json.loads(json.dumps(plan.to_dict()))
    assert report["titan"] == {"batch": 2, "shard": 2}

    from fsdp_plan.export import accelerate, lightning, plan_shape, trainer
    from fsdp_plan.facts.graph import model_outline
    from fsdp_plan.measure import runtime
    shape = plan_shape(plan, model_outline(runtime.load_planned_model(plan, str(model)).model))
    assert shape.model_source == name
    accelerate_config = yaml.safe_load((folders["accelerate"] / accelerate.CONFIG_FILE)
                                       .read_text())
    assert accelerate_config == accelerate.config(plan, shape, hook=True)
    # S4-09: the class name holds a space (or worse): accelerate's list cannot carry it
    assert accelerate_config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == ""
    assert json.loads((folders["trainer"] / trainer.ARGS_FILE).read_text()) == \
        trainer.training_args(shape, hook=True)
    assert yaml.safe_load((folders["lightning"] / lightning.CONFIG_FILE).read_text()) == \
        lightning.trainer_config(plan, shape)
    for framework, out in folders.items():
        readme = (out / "README.md").read_text()
        harmless = (benign[2][framework] / "README.md").read_text()
        assert len(readme.splitlines()) == len(harmless.splitlines()), framework
        assert [line for line in readme.splitlines() if line.startswith(("#", "```"))] == \
            [line.replace("benign", md_name(name)) for line in harmless.splitlines()
             if line.startswith(("#", "```"))], framework
        assert len(stdout[framework].splitlines()) == len(benign[3][framework].splitlines())
    pytest.importorskip("markdown_it")
    for framework, out in folders.items():
        assert _html_tags((out / "README.md").read_text()) == \
            _html_tags((benign[2][framework] / "README.md").read_text()), framework


def md_name(name: str) -> str:
    from fsdp_plan.export.common import md_text
    return md_text(name)


def test_md_text_keeps_one_line_and_escapes_what_opens_markup():
    from fsdp_plan.export.common import md_text, plain_text
    assert md_text("reshard_after_forward (full)") == "reshard_after_forward (full)"
    assert md_text("a\n# b") == "a\\\\n\\# b"
    assert md_text("<b>`x`</b> [l](u) _e_ *s*") == \
        "\\<b\\>\\`x\\`\\</b\\> \\[l\\](u) \\_e\\_ \\*s\\*"
    assert plain_text("red\x1b[31m\u2028") == "red\\x1b[31m\\u2028"


# --- S4-09: a class name the comma-separated list cannot carry goes through the hook ------


def test_a_block_class_named_with_a_comma_is_sent_through_the_code_hook(tmp_path):
    from fsdp_plan.export import accelerate, trainer
    from fsdp_plan.export.common import plan_shape
    from fsdp_plan.facts.graph import model_outline
    from fsdp_plan.measure import runtime

    model, plan, folders, stdout = hostile_export(tmp_path, "Block,Linear")
    shape = plan_shape(plan, model_outline(runtime.load_planned_model(plan, str(model)).model))
    assert shape.block_classes == ("Block,Linear Block",)
    for module in (accelerate, trainer):
        gaps = [g for g in module.config_gaps(shape) if "cannot carry" in g.instead]
        assert gaps and "'Block,Linear Block'" in gaps[0].plan
    config = yaml.safe_load((folders["accelerate"] / "accelerate_config.yaml").read_text())
    assert config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == ""
    assert (folders["accelerate"] / "fsdp_plan_accelerate.py").exists()
    assert (folders["trainer"] / "fsdp_plan_trainer.py").exists()
    assert "no code hook needed" not in stdout["accelerate"]


# --- S4-12: an option the chosen --to does not use is refused --------------------------


@pytest.mark.parametrize("framework", ["accelerate", "trainer", "lightning"])
def test_torchtitan_config_with_another_framework_is_refused(tmp_path, capsys, framework):
    from test_export import config_only_plan
    from test_measure_helpers import plan_file

    path = plan_file(tmp_path, config_only_plan())
    before = tree(tmp_path)
    cli_checks.refused(capsys, ["export", path, "--to", framework, "-o", str(tmp_path / "o"),
                                "--torchtitan-config", "a:b"],
                       "--torchtitan-config applies to --to torchtitan only")
    assert tree(tmp_path) == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("base", ["a", "a:b:c", "a b:c", "x`y:z", "m:f\n# h", ".a:b"])
def test_a_torchtitan_config_that_is_not_module_function_is_refused(tmp_path, capsys, base):
    from test_export import config_only_plan
    from test_measure_helpers import plan_file

    path = plan_file(tmp_path, config_only_plan())
    before = tree(tmp_path)
    err = cli_checks.refused(capsys, ["export", path, "--to", "torchtitan", "-o",
                                      str(tmp_path / "o"), "--torchtitan-config", base],
                             "MODULE:FUNCTION")
    assert len(err.strip().splitlines()) == 1
    assert tree(tmp_path) == before


# --- S4-17: "the whole plan" only when nothing is lost ------------------------------------


def test_an_export_that_loses_something_never_says_it_is_the_whole_plan(tmp_path):
    """A DDP plan to torchtitan: no code hook (none could keep more), and its DDP buckets are
    lost; neither the summary nor the README may call the configuration the whole plan."""
    from test_measure_helpers import plan_file, tiny_llama_plan

    plan = tiny_llama_plan(world=2, batch_size=2, seq_len=16)
    plan.strategy, plan.mesh = "ddp", Mesh(replicate=2, shard=1)
    plan.units = [Unit(modules=[""], reshard_after_forward=False)]
    plan.ddp = {"bucket_cap_mb": 25, "first_bucket_mb": 1}
    path = plan_file(tmp_path, plan)
    out = tmp_path / "t"
    code, printed, err = run_cli(["export", path, "--to", "torchtitan", "-o", str(out),
                                  "--torchtitan-config", "titan_stub:make"])
    assert code == 0, err
    assert "whole plan" not in printed and "lost: ddp" in printed
    assert "no code hook needed" in printed and "are lost" in printed
    readme = (out / "README.md").read_text()
    assert "whole plan" not in readme and "Nothing in the plan is beyond" not in readme
    assert "## No code hook" in readme and "- ddp: the plan has DDP buckets" in readme


# --- S4-02: the model a plan names is an input of every verb -----------------------------


@pytest.fixture
def planned(tmp_path, monkeypatch):
    """``tmp_path/lm.py`` (the tiny Llama's code) and ``tmp_path/pf.yaml``, a plan naming it as
    ``lm.py`` (relative: read from the plan's folder); the working folder is ``tmp_path``."""
    from test_measure_helpers import LLAMA, tiny_llama_plan

    model = tmp_path / "lm.py"
    model.write_text(Path(LLAMA).read_text())
    plan = tiny_llama_plan(world=2, batch_size=2, seq_len=16)
    plan.model = replace(plan.model, source="lm.py")
    write_plan(plan, str(tmp_path / "pf.yaml"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv,flag", [
    (["emit", "pf.yaml", "-o", "lm.py"], "-o"),
    (["predict", "pf.yaml", "--html", "lm.py"], "--html"),
    (["predict", "pf.yaml", "--memory-snapshot", "lm.py"], "--memory-snapshot"),
    (["verify", "pf.yaml", "--memory-snapshot", "lm.py"], "--memory-snapshot"),
    (["verify", "pf.yaml", "--html", "lm.py"], "--html"),
    (["bench", "pf.yaml", "--nproc", "2", "--html", "lm.py"], "--html"),
    (["tune", "pf.yaml", "--out", "tuned", "--html", "lm.py"], "--html"),
    (["export", "pf.yaml", "--to", "accelerate", "-o", "."], "-o"),
], ids=["emit", "predict-html", "predict-snapshot", "verify-snapshot", "verify-html", "bench",
        "tune", "export-into-the-models-folder"])
def test_no_verb_overwrites_the_model_the_plan_names(planned, capsys, argv, flag):
    """Refused before any work (bench before its workers start), naming the model file."""
    if argv[0] == "export":  # the model sits in the output folder under an export's name
        os.rename("lm.py", "fsdp_plan_policy.py")
        doc = yaml.safe_load(Path("pf.yaml").read_text())
        doc["model"]["source"] = "fsdp_plan_policy.py"
        Path("pf.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    before = tree(planned)
    cli_checks.refused(capsys, argv, flag, "is the model file the plan names",
                       "would replace an input")
    assert tree(planned) == before


def test_export_never_overwrites_the_model_through_a_symlink_or_given_as_model(planned,
                                                                               capsys):
    out = planned / "out"
    out.mkdir()
    (out / "README.md").symlink_to(planned / "lm.py")  # README.md -> the model
    before = tree(planned)
    cli_checks.refused(capsys, ["export", "pf.yaml", "--to", "lightning", "-o", "out"],
                       "'out/README.md' is the model file the plan names")
    assert tree(planned) == before
    (out / "README.md").unlink()
    (out / "fsdp_plan_accelerate.py").write_text((planned / "lm.py").read_text())
    before = tree(planned)
    cli_checks.refused(capsys, ["export", "pf.yaml", "out/fsdp_plan_accelerate.py", "--to",
                                "accelerate", "-o", "out"], "is the MODEL")
    assert tree(planned) == before


def test_export_into_its_own_plan_folder_overwriting_nothing_still_works(planned):
    before = tree(planned)
    code, _, err = run_cli(["export", "pf.yaml", "--to", "trainer", "-o", "."])
    assert code == 0, err
    after = tree(planned)
    assert {name: after[name] for name in before} == before
    assert "training_args.json" in after


def test_plan_result_write_never_replaces_the_model_it_was_planned_from(planned):
    from fsdp_plan.api import PlanResult
    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.plan.document import read_plan

    result = PlanResult(plan=read_plan("pf.yaml"), best=None, ranked=[], recipes=[], facts=None,
                        seconds=0.0)
    before = tree(planned)
    with pytest.raises(BadInput, match="policy 'lm.py' is the model file the plan names"):
        result.write(policy="lm.py")
    with pytest.raises(BadInput, match="is the model file the plan names"):
        result.write(policy=str(planned / "p.py"), plan=str(planned / "lm.py"))
    assert tree(planned) == before
    assert result.write(policy="p.py") == ["p.py"]
