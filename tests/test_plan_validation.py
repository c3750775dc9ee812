"""A plan file is validated once, in one place, before anything runs (``fsdp_plan.plan.check``).

Each bad-input row edits a plan the planner wrote for the tiny Llama, runs ``verify`` and
``bench`` in-process from an empty working folder, and asserts the failure contract: exit 2,
a one-paragraph message naming the field (``units[0].modules[0]``) and no command-line flag,
no traceback, nothing written in the working folder or the temporary folder, the plan file
byte-for-byte unchanged. Also: a plan is data (a module it names is never imported), relative
model paths resolve from the plan's folder, version-2 documents, and ``main`` turning any
exception into a one-paragraph message.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from fsdp_plan.cli import main as cli_main
from fsdp_plan.cli.main import VERBS, main
from fsdp_plan.common.errors import BadInput
from fsdp_plan.measure.runtime import source_from_plan
from fsdp_plan.plan.schema import check_plan_document
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.read import MAX_PLAN_BYTES, parse_plan_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
TINY = ["--model-arg", "size=tiny", "--seq-len", "32"]
VERB_ARGS = {"verify": [], "bench": ["--nproc", "1"]}
if os.path.exists(os.path.join(ROOT, "fsdp_plan", "cli", "predict.py")) and "predict" in VERBS:
    VERB_ARGS["predict"] = []


@pytest.fixture(scope="module")
def base_doc(tmp_path_factory) -> dict:
    """The tiny Llama planned at 1.9 MB: a unit per block and per top-level module,
    checkpointing (at 2 MB it now fits without checkpointing, which costs a replay of each
    checkpointed block's ops), and forward prefetch: the first unit prefetches the next, by
    hand where the search chose none (on the h100 preset this step is the host's, so
    prefetching buys it nothing; each unit the next, the uniform depth 1 every verb reads), so
    that every field the table below breaks is there."""
    path = tmp_path_factory.mktemp("base") / "plan.yaml"
    assert main([LLAMA, *TINY, "--mem", "1.9MB", "--plan", str(path), "--format", "json"]) == 0
    doc = yaml.safe_load(path.read_text())
    doc["model"]["source"] = LLAMA  # absolute: the plans below live in other folders
    assert [u["modules"] for u in doc["units"]][-1] == [""] and len(doc["units"]) > 2
    if not any(doc["forward_prefetch"].values()):  # each unit the next: a uniform depth
        keys = [u["modules"][0] for u in doc["units"]][:-1]
        doc["forward_prefetch"] = {a: [b] for a, b in zip(keys, keys[1:])}
    assert doc["activation_checkpointing"] and doc["forward_prefetch"]
    return doc


@pytest.fixture
def place(tmp_path, monkeypatch):
    """An empty working folder and a private temporary folder; plans go to ``plans/``."""
    cwd, tmp, plans = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "plans"
    for folder in (cwd, tmp, plans):
        folder.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    return {"cwd": cwd, "tmp": tmp, "plans": plans}


def write_plan(place, content: dict | bytes | str, name: str = "plan.yaml") -> Path:
    path = place["plans"] / name
    if isinstance(content, dict):
        content = yaml.safe_dump(content, sort_keys=False)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


def refused(capsys, place, verb: str, content, *needles: str, model: str | None = None) -> str:
    """Run ``verb`` on a plan holding ``content``; assert the bad-input contract, return stderr."""
    path = write_plan(place, content)
    before = path.read_bytes()
    argv = [verb, str(path), *([model] if model else []), *VERB_ARGS[verb]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, f"not one paragraph: {err}"
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err}"
    for flag in ("--batch-size", "--seq-len", "--world-size", "--nproc", "--mem", "--model-arg"):
        assert flag not in err, f"a plan-file error names the flag {flag}: {err}"
    assert os.listdir(place["cwd"]) == [], "a refused plan left files in the working folder"
    assert os.listdir(place["tmp"]) == [], "a refused plan left files in the temporary folder"
    assert os.listdir(place["plans"]) == [path.name]
    assert path.read_bytes() == before, "the plan file changed"
    return err


def edit(doc: dict, change) -> dict:
    doc = copy.deepcopy(doc)
    change(doc)
    return doc


def rename_module(doc: dict, old: str, new: str) -> None:
    """Rename a unit module everywhere the plan names it (so only the model check can object)."""
    for unit in doc["units"]:
        unit["modules"] = [new if m == old else m for m in unit["modules"]]
    doc["activation_checkpointing"] = [new if m == old else m
                                       for m in doc["activation_checkpointing"]]
    for kind in ("forward_prefetch", "backward_prefetch"):
        doc[kind] = {(new if k == old else k): [new if t == old else t for t in v]
                     for k, v in doc[kind].items()}


def first_key(doc: dict) -> str:
    return doc["units"][0]["modules"][0]


# --- the bad-input table ------------------------------------------------------------------------

CASES = {
    "unit module not in the model": (
        lambda d: rename_module(d, first_key(d), "layers.99"),
        ["units[0].modules[0]", "'layers.99'", "does not have", "MODEL"]),
    "checkpointed module not in the model": (
        lambda d: d.update(activation_checkpointing=["layers.0.nope"]),
        ["activation_checkpointing[0]", "'layers.0.nope'", "does not have"]),
    "no units": (lambda d: d.update(units=[]), ["units is empty", "root"]),
    "prefetch key not a unit": (
        lambda d: d.update(forward_prefetch={"norm": [first_key(d)]}),
        ["forward_prefetch['norm']", "not a unit key"]),
    "prefetch target not a unit": (
        lambda d: d.update(backward_prefetch={"layers.0": ["layers.1.attention"]}),
        ["backward_prefetch['layers.0'][0]", "not a unit key"]),
    "unit prefetching itself": (
        lambda d: d.update(backward_prefetch={"layers.0": ["layers.0"]}),
        ["backward_prefetch['layers.0'][0]", "itself"]),
    "root checkpointed": (
        lambda d: d.update(activation_checkpointing=[""]),
        ["activation_checkpointing[0]", "root"]),
    "checkpointed twice": (
        lambda d: d.update(activation_checkpointing=["layers.0", "layers.0"]),
        ["activation_checkpointing[1]", "twice"]),
    "int8 param dtype": (
        lambda d: d["mixed_precision"].update(param_dtype="int8"),
        ["mixed_precision.param_dtype", "'int8'", "bfloat16"]),
    "world size 0": (lambda d: d.update(world_size=0), ["world_size", "1048576", "cluster"]),
    "world size -2": (lambda d: d.update(world_size=-2), ["world_size", "outside"]),
    "world size 1e9": (lambda d: d.update(world_size=1000000000), ["world_size", "1048576"]),
    "world size 2**31": (lambda d: d.update(world_size=2147483648), ["world_size", "1048576"]),
    "world size 1.5": (lambda d: d.update(world_size=1.5), ["world_size", "whole number"]),
    "world size true": (lambda d: d.update(world_size=True), ["world_size", "boolean"]),
    "budget inf": (lambda d: d.update(budget_bytes=float("inf")),
                   ["budget_bytes", ".inf", "whole number"]),
    "budget nan": (lambda d: d.update(budget_bytes=float("nan")), ["budget_bytes", ".nan"]),
    "budget -5": (lambda d: d.update(budget_bytes=-5), ["budget_bytes", "outside", "2**60"]),
    "headroom above budget": (lambda d: d.update(headroom_bytes=d["budget_bytes"]),
                              ["headroom_bytes", "budget_bytes - 1"]),
    "args a string": (lambda d: d["model"].update(args="size=tiny"),
                      ["model.args", "mapping"]),
    "args key not an identifier": (lambda d: d["model"].update(args={"not ok": 1}),
                                   ["model.args['not ok']", "keyword-argument"]),
    "control characters in a key": (lambda d: d["mesh"].update({"\x1b[2J\nboom": 1}),
                                    ["mesh['\\x1b[2J\\nboom']", "not a key"]),
    "batch size abc": (lambda d: d["model"].update(batch_size="abc"),
                       ["model.batch_size", "'abc'", "batch_size: 1"]),
    "batch size -4": (lambda d: d["model"].update(batch_size=-4),
                      ["model.batch_size", "-4", "batch_size: 1"]),
    "seq len 1.5": (lambda d: d["model"].update(seq_len=1.5), ["model.seq_len", "1.5"]),
    "version 3": (lambda d: d.update(fsdp_plan_version=3), ["fsdp_plan_version 3", "version 2"]),
    "no version": (lambda d: d.pop("fsdp_plan_version"), ["no fsdp_plan_version"]),
    "mesh not world size": (lambda d: d.update(mesh={"replicate": 2, "shard": 2}),
                            ["mesh", "2x2", "world_size is 8"]),
    "mesh typo": (lambda d: d["mesh"].update(replica=1), ["mesh.replica", "replicate, shard"]),
    "full with replicas": (lambda d: d.update(mesh={"replicate": 2, "shard": 4}),
                           ["strategy", "mesh.replicate is 2", "hybrid"]),
    "none that shards": (lambda d: d.update(strategy="none"), ["strategy", "mesh.shard is 8"]),
    "grad-op resharding": (lambda d: d.update(strategy="grad-op"),
                           ["units[0].reshard_after_forward", "grad-op"]),
    "unknown strategy": (lambda d: d.update(strategy="zero3"), ["strategy", "'zero3'"]),
    "ddp that shards": (lambda d: d.update(strategy="ddp"), ["strategy is ddp", "mesh.shard is 8"]),
    "ddp with units": (lambda d: d.update(strategy="ddp", mesh={"replicate": 8, "shard": 1}),
                       ["units", "one unit"]),
    "ddp bucket cap zero": (lambda d: d.update(strategy="ddp", mesh={"replicate": 8, "shard": 1},
                                               units=[{"modules": [""]}], forward_prefetch={}, backward_prefetch={}, ddp={"bucket_cap_mb": 0}),
                            ["ddp.bucket_cap_mb", "more than 0"]),
    "ddp flag not a bool": (lambda d: d.update(strategy="ddp", mesh={"replicate": 8, "shard": 1},
                                               units=[{"modules": [""]}], forward_prefetch={}, backward_prefetch={},
                                               ddp={"static_graph": "yes"}),
                            ["ddp.static_graph", "true or false"]),
    "ddp first bucket larger": (lambda d: d.update(
        strategy="ddp", mesh={"replicate": 8, "shard": 1}, units=[{"modules": [""]}], forward_prefetch={}, backward_prefetch={},
        ddp={"bucket_cap_mb": 5, "first_bucket_mb": 10}), ["ddp.first_bucket_mb", "at most"]),
    "unknown optimizer": (lambda d: d.update(optimizer="lion"), ["optimizer", "'lion'"]),
    "root not last": (lambda d: d["units"].insert(0, d["units"].pop()),
                      ["units[0].modules[0]", "root", "last"]),
    "no root unit": (lambda d: d["units"].pop(), ["is not the root unit"]),
    "module in two units": (lambda d: d["units"][1]["modules"].append(first_key(d)),
                            ["units[1].modules[1]", "already in units[0]"]),
    "parent before child": (lambda d: d["units"].insert(0, {"modules": ["layers"]}),
                            ["modules[0]", "after its parent 'layers'"]),
    "empty modules": (lambda d: d["units"][0].update(modules=[]),
                      ["units[0].modules is empty"]),
    "module not a string": (lambda d: d["units"][0].update(modules=[5]),
                            ["units[0].modules[0]", "must be a string"]),
    "reshard not a bool": (lambda d: d["units"][0].update(reshard_after_forward="yes"),
                           ["units[0].reshard_after_forward", "true or false"]),
    "unit precision int8": (lambda d: d["units"][0].update(mixed_precision={"param_dtype": "int8"}),
                            ["units[0].mixed_precision.param_dtype", "'int8'"]),
    "unit precision typo": (lambda d: d["units"][0].update(mixed_precision={"out_dtype": "bf16"}),
                            ["units[0].mixed_precision.out_dtype", "output_dtype"]),
    "unit key typo": (lambda d: d["units"][0].update(reshard_after_foward=False),
                      ["units[0].reshard_after_foward", "not a key"]),
    "predicted peak negative": (lambda d: d["predicted"].update(peak_bytes=-1),
                                ["predicted.peak_bytes", "outside"]),
    "predicted breakdown nan": (lambda d: d["predicted"]["breakdown"].update(inputs=float("nan")),
                                ["predicted.breakdown.inputs", ".nan"]),
    "offload of params without optimizer": (lambda d: d.update(
        fsdp_plan_version=2, offload={"params": True, "optimizer": False}),
        ["offload", "together"]),
    "ddp block without ddp": (lambda d: d.update(ddp={"bucket_cap_mb": 25}),
                              ["ddp is present", "strategy: ddp"]),
    "gradient accumulation of zero steps": (lambda d: d.update(grad_accum_steps=0),
                                            ["grad_accum_steps", "whole number"]),
    "unknown gradient sync": (lambda d: d.update(grad_accum_steps=2, gradient_sync="sometimes"),
                              ["gradient_sync", "every"]),
    "selective without saved ops": (
        lambda d: d.update(fsdp_plan_version=2, activation_checkpointing={"layers.0": "selective"}),
        ["activation_checkpointing['layers.0']", "selective_ops lists no ops"]),
    "checkpoint mapping in version 1": (
        lambda d: d.update(activation_checkpointing={"layers.0": "full"}),
        ["activation_checkpointing is a mapping", "fsdp_plan_version: 2"]),
    "entry not a name": (lambda d: d["model"].update(entry="os.system"), ["model.entry"]),
    "entry a dunder": (lambda d: d["model"].update(entry="__class__"),
                       ["model.entry", "'__class__'", "factory"]),
    "model without source": (lambda d: d["model"].pop("source"), ["model has no source"]),
    "infinite number the policy would hold": (lambda d: d["model"].update(extra=float("inf")),
                                              ["model.extra", "finite numbers only"]),
    "nan in the report": (lambda d: d["predicted"].update(peak_phase=float("nan")),
                          ["predicted.peak_phase", "finite numbers only"]),
    "number as a key": (lambda d: d["predicted"].update({1: 2}), ["predicted has the key 1"]),
}


@pytest.mark.parametrize("verb", list(VERB_ARGS))
@pytest.mark.parametrize("case", list(CASES))
def test_bad_plan_is_refused(base_doc, place, capsys, verb, case):
    change, needles = CASES[case]
    refused(capsys, place, verb, edit(base_doc, change), *needles)


RAW_CASES = {
    "binary file": (b"\x00\x01\x02fsdp_plan_version: 1\n" * 10, ["binary data"]),
    "not UTF-8": ("fsdp_plan_version: 1\nmodel: caf\xe9\n".encode("latin-1"), ["not UTF-8"]),
    "empty file": (b"", ["is empty"]),
    "not a mapping": (b"- a\n- b\n", ["not a fsdp-plan plan file"]),
    "python tag": (b"fsdp_plan_version: 1\nmodel: !!python/object/apply:os.system ['touch x']\n",
                   ["YAML tag", "plain data"]),
    "binary tag": (b"fsdp_plan_version: 1\nmodel: !!binary aGVsbG8=\n", ["YAML tag"]),
    "local tag": (b"fsdp_plan_version: 1\nmodel: !mine {source: x.py}\n", ["YAML tag"]),
    "recursive alias": (b"fsdp_plan_version: 1\nmodel: &m {source: x.py, args: *m}\n",
                        ["recursive alias", "line 2"]),
    "recursive args alias": (b"fsdp_plan_version: 1\nmodel: {source: x.py, args: &a {x: [*a]}}\n",
                             ["recursive alias"]),
    "billion laughs": (("fsdp_plan_version: 1\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
                        + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n"
                                  for i in range(1, 10))).encode(),
                       ["more than 1,000,000 values"]),
    "deep nesting": (b"fsdp_plan_version: 1\nmodel: " + b"[" * 5000 + b"]" * 5000 + b"\n",
                     ["more than 64 deep"]),
    "duplicate key": (b"fsdp_plan_version: 1\nworld_size: 8\nworld_size: 1\n",
                      ["'world_size' twice", "line 3"]),
    "not YAML": (b"fsdp_plan_version: 1\nmodel: {source: [}\n", ["cannot be read as YAML"]),
    "date in the model": (b"fsdp_plan_version: 1\nmodel: {source: x.py, made: 2024-01-01}\n",
                          ["model.made", "quote dates"]),
    "lone surrogate": (b'fsdp_plan_version: 1\nmodel: {source: "x\\ud800.py"}\n',
                       ["cannot be read as YAML", "Unicode"]),
    "huge integer": (b"fsdp_plan_version: 1\nbudget_bytes: " + b"9" * 5000 + b"\n",
                     ["cannot turn into data"]),
}


@pytest.mark.parametrize("verb", list(VERB_ARGS))
@pytest.mark.parametrize("case", list(RAW_CASES))
def test_bad_plan_bytes_are_refused(place, capsys, verb, case):
    content, needles = RAW_CASES[case]
    refused(capsys, place, verb, content, *needles)


@pytest.mark.parametrize("verb", list(VERB_ARGS))
def test_a_20_mb_plan_is_refused_before_parsing(place, capsys, verb):
    content = b"fsdp_plan_version: 1\n" + b"# padding padding padding padding\n" * (20 * 2**20 // 34)
    assert len(content) > MAX_PLAN_BYTES
    started = time.perf_counter()
    refused(capsys, place, verb, content, "larger than 16 MiB", "not a plan file")
    assert time.perf_counter() - started < 2.0


def test_missing_plan_and_folder_plan(place, capsys):
    for target, needle in ((place["plans"] / "nope.yaml", "does not exist"),
                           (place["plans"], "is a folder")):
        assert main(["verify", str(target)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_verify_runs_a_valid_plan(base_doc, place, capsys):
    """The control for the table: the unedited plan passes verify from the same place."""
    path = write_plan(place, base_doc)
    code = main(["verify", str(path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "verify: OK" in out.out
    assert os.listdir(place["cwd"]) == [] and os.listdir(place["tmp"]) == []


# --- a plan is data: what it names is never imported ----------------------------------------

PWNED_MODELS = {
    "import kind": {"source": "os:system", "kind": "import", "args": {"command": "touch pwned"}},
    "kind left out": {"source": "os:system", "args": {"command": "touch pwned"}},
    "file kind, not a .py": {"source": "os:system", "kind": "file",
                             "args": {"command": "touch pwned"}},
    "config kind, not a .json": {"source": "os:system", "kind": "hf-config",
                                 "args": {"command": "touch pwned"}},
    "a .py that does not exist": {"source": "pwned_model.py", "args": {}},
}


@pytest.fixture
def no_system(monkeypatch):
    """Records any os.system call instead of running it."""
    calls: list = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append((a, k)) or 0)
    return calls


@pytest.mark.parametrize("verb", list(VERB_ARGS))
@pytest.mark.parametrize("case", list(PWNED_MODELS))
def test_a_plan_never_imports_what_it_names(base_doc, place, capsys, no_system, verb, case):
    doc = edit(base_doc, lambda d: d.update(model=PWNED_MODELS[case]))
    err = refused(capsys, place, verb, doc, "MODEL")
    assert not (place["cwd"] / "pwned").exists() and not no_system, err


def test_an_import_named_in_a_plan_says_how_to_trust_it(base_doc, place, capsys, no_system):
    doc = edit(base_doc, lambda d: d.update(model=PWNED_MODELS["import kind"]))
    err = refused(capsys, place, "verify", doc, "kind: import", "does not import",
                  "fsdp-plan verify PLAN.yaml os:system")
    assert not no_system, err


def test_the_suggested_command_is_safe_to_paste(base_doc):
    """The plan's text is quoted for the shell, so pasting the suggestion runs nothing else."""
    plan = Plan.from_dict(edit(base_doc, lambda d: d.update(
        model={"source": "os:system; touch pwned", "kind": "import"})))
    with pytest.raises(BadInput, match=r"verify PLAN\.yaml 'os:system; touch pwned'\)"):
        source_from_plan(plan)


def test_the_model_on_the_command_line_is_the_authority(base_doc, place, capsys):
    """MODEL replaces an untrusted source: the plan still verifies against the real model."""
    doc = edit(base_doc, lambda d: d["model"].update(source="os:system", kind="import"))
    path = write_plan(place, doc)
    code = main(["verify", str(path), LLAMA])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert os.listdir(place["cwd"]) == []


# --- where a relative model path is found -----------------------------------------------------

def plan_with_source(base_doc: dict, source: str) -> Plan:
    return Plan.from_dict(edit(base_doc, lambda d: d["model"].update(source=source)))


def test_relative_source_is_read_from_the_plan_folder_first(base_doc, place):
    beside = place["plans"] / "models"
    beside.mkdir()
    (beside / "llama.py").write_text(Path(LLAMA).read_text())
    (place["cwd"] / "models").mkdir()
    (place["cwd"] / "models" / "llama.py").write_text("raise SystemExit('wrong file')\n")
    plan_path = str(place["plans"] / "plan.yaml")
    source = source_from_plan(plan_with_source(base_doc, "models/llama.py"), plan_path=plan_path)
    assert source.source == str(beside / "llama.py")
    assert source.kind == "file" and source.args == {"size": "tiny"} and source.seq_len == 32


def test_relative_source_falls_back_to_the_working_folder(base_doc, place):
    (place["cwd"] / "mine.py").write_text("x = 1\n")
    source = source_from_plan(plan_with_source(base_doc, "mine.py"),
                              plan_path=str(place["plans"] / "plan.yaml"))
    assert source.source == str(place["cwd"] / "mine.py")


def test_a_bundled_policy_resolves_its_model_from_another_folder(place):
    path = os.path.join(ROOT, "policies", "llama8b_h100x8.yaml")
    source = source_from_plan(read_plan(path), plan_path=path)
    assert source.source == LLAMA and source.args == {"size": "8b"}


def test_a_missing_model_names_the_model_argument(base_doc, place):
    with pytest.raises(BadInput, match=r"not found as a file.*optional MODEL argument"):
        source_from_plan(plan_with_source(base_doc, "gone/model.py"),
                         plan_path=str(place["plans"] / "plan.yaml"))


def test_a_model_folder_is_not_a_model_file(base_doc, place):
    (place["plans"] / "dir.py").mkdir()
    with pytest.raises(BadInput, match="not found as a file"):
        source_from_plan(plan_with_source(base_doc, "dir.py"),
                         plan_path=str(place["plans"] / "plan.yaml"))


# --- version 2 and round trips --------------------------------------------------------------

def test_version_2_simple_forms_are_read(base_doc):
    doc = edit(base_doc, lambda d: d.update(
        fsdp_plan_version=2, activation_checkpointing={"layers.0": "full", "layers.1": "full"},
        selective_ops=["aten.mm.default"], offload={"params": False, "optimizer": False},
        grad_accum_steps=1))
    plan = Plan.from_dict(doc)
    assert plan.fsdp_plan_version == 2
    assert plan.activation_checkpointing == ["layers.0", "layers.1"]
    # a key no fsdp-plan writes is refused, never dropped (issue 31, S4-10)
    with pytest.raises(BadInput, match="something_new is not a key of a fsdp-plan plan"):
        Plan.from_dict({**doc, "something_new": {"added": "by another tool"}})


def test_a_unit_may_carry_its_own_precision(base_doc):
    """A batch norm unit is float32 under bf16 (units.with_full_precision_units)."""
    override = {"param_dtype": "float32", "output_dtype": "bfloat16"}
    doc = edit(base_doc, lambda d: d["units"][0].update(mixed_precision=override))
    plan = Plan.from_dict(doc)
    assert plan.units[0].mixed_precision == override and plan.units[1].mixed_precision is None
    assert plan.to_dict() == doc  # units without one do not grow a null key


def test_written_plans_round_trip(base_doc):
    plan = Plan.from_dict(base_doc)
    assert plan.to_dict() == base_doc
    assert Plan.from_dict(plan.to_dict()).to_dict() == base_doc


@pytest.mark.parametrize("name", sorted(p.name for p in Path(ROOT, "policies").glob("*.yaml")))
def test_bundled_policies_validate(name):
    plan = read_plan(os.path.join(ROOT, "policies", name))
    assert plan.units[-1].modules == [""]


def test_strategy_defaults_from_the_mesh(base_doc):
    doc = edit(base_doc, lambda d: (d.pop("strategy"), d.update(mesh={"replicate": 2,
                                                                     "shard": 4})))
    assert Plan.from_dict(doc).strategy == "hybrid"
    doc = edit(base_doc, lambda d: d.pop("strategy"))
    assert Plan.from_dict(doc).strategy == "full"


def test_hybrid_with_one_replica_is_what_the_planner_writes(base_doc):
    assert Plan.from_dict(edit(base_doc, lambda d: d.update(strategy="hybrid"))).strategy == "hybrid"


def test_python_objects_that_are_not_yaml_are_refused(base_doc):
    cyclic = edit(base_doc, lambda d: None)
    cyclic["model"]["args"]["self"] = cyclic["model"]["args"]
    with pytest.raises(BadInput, match=r"plan: model\.args\.self contains itself"):
        check_plan_document(cyclic)
    odd = edit(base_doc, lambda d: None)
    odd["predicted"]["when"] = object()
    with pytest.raises(BadInput, match=r"plan: predicted\.when is a value of type object"):
        check_plan_document(odd)


def test_lone_surrogates_are_refused_whatever_the_loader(base_doc):
    """libyaml refuses "\\ud800" escapes; PyYAML's pure-Python loader builds them."""
    with pytest.raises(BadInput, match=r"model\.source is not valid Unicode"):
        check_plan_document(edit(base_doc, lambda d: d["model"].update(source="m\ud800.py")))
    assert yaml.load('a: "\\ud800"', Loader=yaml.SafeLoader) == {"a": "\ud800"}


def test_reading_uses_the_c_loader_when_there_is_one():
    assert parse_plan_text(b"a: 1\n") == {"a": 1}
    if hasattr(yaml, "CSafeLoader"):
        from fsdp_plan.common import safe_yaml
        assert safe_yaml._loader() is yaml.CSafeLoader


def test_a_parser_with_its_own_nesting_limit_says_the_same(monkeypatch):
    """Newer libyaml builds refuse ~1,000 open flow levels while scanning ahead, before any
    event reaches the depth check; the refusal reads the same on every build."""
    def parse_with_a_limit(text, Loader):
        yield yaml.StreamStartEvent()
        raise yaml.scanner.ScannerError("while increasing flow level", None,
                                        "exceeded maximum nesting depth", None)
    monkeypatch.setattr(yaml, "parse", parse_with_a_limit)
    with pytest.raises(BadInput, match="more than 64 deep"):
        parse_plan_text(b"model: [[[[]]]]\n")


# --- main: every error is one paragraph ---------------------------------------------------------

@pytest.mark.parametrize("error, code, needle", [
    (ValueError("boom\nsecond line"), 1, "internal error: ValueError: boom second line"),
    (TypeError("bad type"), 1, "internal error: TypeError"),
    (RuntimeError("kernel"), 1, "rerun with --debug and report it"),
    (KeyError("k"), 1, "internal error: KeyError"),
    (OSError(28, "No space left on device", "out.json"), 2, "No space left on device 'out.json'"),
    (MemoryError(), 2, "ran out of host memory"),
    (RecursionError("maximum recursion depth exceeded"), 2, "recursion limit"),
    (SystemExit(0), 2, "sys.exit(0)"),
])
def test_main_maps_every_error_to_one_paragraph(monkeypatch, capsys, tmp_path, error, code,
                                                needle):
    from fsdp_plan.cli import verify

    def explode(args):
        raise error
    monkeypatch.setattr(verify, "run", explode)
    assert main(["verify", str(tmp_path / "p.yaml")]) == code
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1, err
    assert main(["verify", str(tmp_path / "p.yaml"), "--debug"]) == code
    assert "Traceback" in capsys.readouterr().err


def test_help_lists_every_verb_with_its_summary(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb, module in VERBS.items():
        summary = cli_main.verb_summary(module)
        assert summary and summary != "(unavailable)"
        assert f"  {verb}" in out and summary in out
    for verb in VERBS:
        assert main([verb, "--help"]) == 0
        assert f"usage: fsdp-plan {verb}" in capsys.readouterr().out


@pytest.mark.slow
def test_issue_9_plan_cannot_run_a_command_through_the_real_cli(base_doc, place):
    """The reported reproduction, through the installed entry point in a fresh process."""
    import subprocess
    import sys

    doc = edit(base_doc, lambda d: d.update(model={"source": "os:system", "kind": "import",
                                                   "args": {"command": "touch pwned"}}))
    path = write_plan(place, doc, "p.yaml")
    env = {**os.environ, "TMPDIR": str(place["tmp"])}
    for verb, extra in VERB_ARGS.items():
        proc = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", verb, str(path), *extra],
                              cwd=place["cwd"], capture_output=True, text=True, timeout=300,
                              env=env, check=False)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and "MODEL" in proc.stderr, proc.stderr
        assert proc.stdout == ""
        assert os.listdir(place["cwd"]) == [] and os.listdir(place["tmp"]) == []
