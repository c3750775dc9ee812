"""Model facts cached on disk (issue 29, [Note: the facts cache] in facts/cache.py): a second
plan of the same model at another budget or world size runs no tracing, gives the same plan,
and a corrupt, stale or foreign entry is never trusted. Every test uses its own folder; the
suite has the cache off (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_plan.cli.main import main
from fsdp_plan.facts import analyze
from fsdp_plan.facts.cache import FORMAT, FactsCache, cache_dir, facts_key
from fsdp_plan.model.source import ModelSource

ROOT = Path(__file__).resolve().parent.parent
LLAMA = str(ROOT / "examples" / "llama.py")
ARGS = [LLAMA, "--model-arg", "size=tiny", "--seq-len", "64", "--batch-size", "2",
        "--world-size", "4", "--format", "json"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "facts"
    monkeypatch.delenv("FSDP_PLAN_NO_CACHE", raising=False)
    monkeypatch.setenv("FSDP_PLAN_CACHE_DIR", str(folder))
    return folder


def _plan(capsys, *extra: str) -> dict:
    assert main([*ARGS, *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    out.pop("planning_seconds")
    return out


def _no_tracing(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("traced although the facts were cached")
    monkeypatch.setattr(analyze, "analyze_loaded", refuse)


def test_the_suite_runs_with_the_cache_off():
    assert os.environ.get("FSDP_PLAN_NO_CACHE") == "1" and cache_dir() is None


def _facts_entries(cache: Path) -> list[Path]:
    """The folder's facts entries (beside them: the model's outline, ``<key>.outline.json``)."""
    return sorted(p for p in cache.iterdir() if not p.name.endswith(".outline.json"))


def test_a_second_plan_reads_the_facts_and_plans_the_same(cache, capsys, monkeypatch):
    first = _plan(capsys, "--mem", "3MB")
    entries = sorted(cache.iterdir())
    assert len(_facts_entries(cache)) == 1 and len(entries) == 2  # the facts and the outline
    assert all(p.suffix == ".json" for p in entries)
    _no_tracing(monkeypatch)
    assert _plan(capsys, "--mem", "3MB") == first
    # another budget and world size: the same facts, no tracing
    other = _plan(capsys, "--mem", "50MB", "--world-size", "8")
    assert other["plan"]["world_size"] == 8
    assert sorted(cache.iterdir()) == entries


def test_no_cache_traces_and_writes_nothing(cache, capsys):
    _plan(capsys, "--mem", "3MB", "--no-cache")
    assert not cache.exists()


def test_a_corrupt_or_foreign_entry_is_ignored_and_replaced(cache, capsys, monkeypatch):
    first = _plan(capsys, "--mem", "3MB")
    (entry,) = _facts_entries(cache)
    names = sorted(p.name for p in cache.iterdir())
    for bad in ("{not json", json.dumps({"format": FORMAT, "key": "another", "facts": {}}),
                json.dumps({"format": FORMAT - 1, "key": entry.stem, "digest": "x",
                            "notes": [], "ddp_autocast": False, "facts": _entry(cache)["facts"]}),
                json.dumps({"format": FORMAT, "key": entry.stem, "digest": "x", "notes": [],
                            "facts": {"facts_version": -1}})):
        entry.write_text(bad)
        assert _plan(capsys, "--mem", "3MB") == first  # traced again
        assert json.loads(entry.read_text())["key"] == entry.stem  # and replaced
    assert sorted(p.name for p in cache.iterdir()) == names  # no temporary file left


def test_the_key_covers_the_model_its_shape_and_the_options(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("def build_model():\n    pass\n")
    source = ModelSource(source=str(model), batch_size=1, seq_len=8)
    options = {"param_dtype": "bfloat16"}
    key = facts_key(source, options)
    assert key is not None and key == facts_key(source, dict(options))
    assert key != facts_key(ModelSource(source=str(model), batch_size=2, seq_len=8), options)
    assert key != facts_key(ModelSource(source=str(model), batch_size=1, seq_len=8,
                                        args={"n": 1}), options)
    assert key != facts_key(source, {"param_dtype": "float32"})
    (tmp_path / "helper.py").write_text("X = 1\n")  # a local import beside the model
    assert facts_key(source, options) != key
    model.write_text("def build_model():\n    return None\n")
    assert facts_key(source, options) != key
    assert facts_key(ModelSource(source=str(tmp_path / "missing.py")), options) is None


def test_an_unwritable_cache_costs_only_the_tracing(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.delenv("FSDP_PLAN_NO_CACHE", raising=False)
    monkeypatch.setenv("FSDP_PLAN_CACHE_DIR", str(blocker / "facts"))  # under a file
    assert FactsCache.default() is not None
    _plan(capsys, "--mem", "3MB")


def test_a_plan_from_cached_facts_imports_no_torch(cache, capsys):
    _plan(capsys, "--mem", "3MB")
    code = ("import sys; from fsdp_plan.cli.main import main; "
            f"code = main({[*ARGS, '--mem', '5MB']!r}); "
            "sys.stderr.write('TORCH ' + str('torch' in sys.modules) + '\\n'); sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TORCH False" in out.stderr


def _entry(cache: Path) -> dict:
    (entry,) = _facts_entries(cache)
    return json.loads(entry.read_text())


def test_budgets_with_and_without_ddps_autocast_step_share_one_entry(cache, capsys,
                                                                     monkeypatch):
    """Whether DDP's autocast step is traced depends on the budget (DDP cannot fit below
    twice the parameters' bytes): an entry holding it serves every budget, read without it
    where tracing would leave it out, and is never replaced by one without it. (A budget that
    left it out once made every later plan of the other kind trace again, and overwrite.)"""
    # limits 2.0 and 3.0 MB; twice the parameters' bytes 2.1 MB
    small = ("--mem", "3MB", "--headroom", "1MB", "--world-size", "16")
    large = ("--mem", "3MB", "--headroom", "0", "--world-size", "16")
    monkeypatch.setenv("FSDP_PLAN_NO_CACHE", "1")
    fresh_small, fresh_large = _plan(capsys, *small), _plan(capsys, *large)
    monkeypatch.delenv("FSDP_PLAN_NO_CACHE")
    assert _plan(capsys, *small) == fresh_small
    assert _entry(cache)["ddp_autocast"] is False
    assert _plan(capsys, *large) == fresh_large  # traced again: the entry lacked the step
    assert _entry(cache)["ddp_autocast"] is True
    _no_tracing(monkeypatch)
    assert _plan(capsys, *small) == fresh_small  # the step left out, as tracing leaves it
    assert _entry(cache)["ddp_autocast"] is True  # and the entry kept
    assert _plan(capsys, *large) == fresh_large


def test_facts_to_dict_is_dataclasses_asdict():
    """``ModelFacts.to_dict`` converts without ``asdict``'s deep copies (facts/types.py
    ``plain_data``) and gives ``asdict``'s dict: on a traced model's facts, and on the
    values ``asdict`` treats specially (tuples, namedtuples, dict keys, nested dataclasses)."""
    import collections
    import dataclasses

    from fsdp_plan.api import analyze_model
    from fsdp_plan.facts.types import FACTS_VERSION, plain_data

    facts = analyze_model(ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2,
                                      seq_len=64), ddp_limit_bytes=10**12).facts
    assert facts.analysis.ddp_analysis is not None  # nested facts converted too
    assert facts.to_dict() == {"facts_version": FACTS_VERSION,
                               "graph": dataclasses.asdict(facts.graph),
                               "analysis": dataclasses.asdict(facts.analysis)}
    # the cache's form (events as columns) reads back the same facts, DDP's analysis too
    from fsdp_plan.facts.types import ModelFacts
    compact = json.loads(json.dumps(facts.to_dict(columns=True)))
    assert "event_columns" in compact["analysis"]["ddp_analysis"]["timeline"]
    assert ModelFacts.from_dict(compact) == facts
    point = collections.namedtuple("point", "x y")

    @dataclasses.dataclass
    class Inner:
        values: tuple = (1, 2.5)

    @dataclasses.dataclass
    class Outer:
        inner: Inner
        named: object
        keyed: dict
        items: list

    value = Outer(inner=Inner(), named=point([1], {"a": Inner()}), keyed={(1, 2): [Inner()]},
                  items=[None, True, "s", {"k": (Inner(),)}])
    converted = plain_data(value)
    assert converted == dataclasses.asdict(value)
    assert type(converted["named"]) is point and converted["named"].x is not value.named.x


def _export(plan: Path, out: Path, **env: str) -> tuple[subprocess.CompletedProcess, bool]:
    """``fsdp-plan export --to accelerate`` in a fresh process: its result, and whether it
    imported torch."""
    code = ("import sys; from fsdp_plan.cli.main import main; "
            f"code = main(['export', '--to', 'accelerate', '-o', {str(out)!r}, {str(plan)!r}]); "
            "sys.stderr.write('TORCH ' + str('torch' in sys.modules) + '\\n'); sys.exit(code)")
    out_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=out_env, cwd=ROOT, timeout=600, check=False)
    return done, "TORCH True" in done.stderr


def test_the_cache_keeps_the_op_counters_shared_as_traced():
    """A deep model's repeated blocks share their op counter objects (facts/depth.py), and
    the search sums and times them once per object: read back from the cache's form, the
    events that shared one share one again, and equal counters that did not, do not."""
    from fsdp_plan.facts.types import Event, Timeline, _timeline, plain_data

    shared, other = {"mm_large": 2.0, "ops": 1.0}, {"memory_bytes": 3.0}
    events = [Event(kind="pre_fw", module="a", level=i, peak=i + 1, flops=float(i), ops=o)
              for i, o in enumerate([shared, None, other, shared, dict(shared)])]
    written = json.loads(json.dumps(plain_data(Timeline(events=events), columns=True)))
    assert len(written["ops_table"]) == 3  # one entry per object, not per event
    back = _timeline(written)
    assert back.events == events
    ops = [e.ops for e in back.events]
    assert ops[0] is ops[3] and ops[1] is None
    assert ops[4] == ops[0] and ops[4] is not ops[0] and ops[2] is not ops[0]


def test_an_export_of_a_planned_model_builds_nothing_and_writes_the_same_files(cache, capsys,
                                                                              tmp_path):
    """Planning leaves the model's outline beside its facts; export reads the plan against
    it without importing torch (issue 29), and writes what building the model writes."""
    plan = tmp_path / "plan.yaml"
    _plan(capsys, "--mem", "3MB", "-o", str(tmp_path / "policy.py"), "--plan", str(plan))
    (outline,) = cache.glob("*.outline.json")
    done, torch_imported = _export(plan, tmp_path / "cached")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not torch_imported
    built, torch_imported = _export(plan, tmp_path / "built", FSDP_PLAN_NO_CACHE="1")
    assert built.returncode == 0 and torch_imported, built.stderr[-2000:]
    files = sorted(p.name for p in (tmp_path / "built").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cached").iterdir()) and files
    for name in files:
        assert (tmp_path / "cached" / name).read_bytes() == (tmp_path / "built" / name).read_bytes()
    # a corrupt outline is not trusted: the model is built again and the entry replaced
    outline.write_text(json.dumps({"format": FORMAT, "key": "x", "outline": {}}))
    again, torch_imported = _export(plan, tmp_path / "again")
    assert again.returncode == 0 and torch_imported, again.stderr[-2000:]
    assert json.loads(outline.read_text())["key"] == outline.name.split(".")[0]
    assert _export(plan, tmp_path / "last")[1] is False


def test_a_model_outline_reads_back_what_it_writes():
    from fsdp_plan.facts.graph import model_outline
    from fsdp_plan.facts.types import ModelOutline
    from fsdp_plan.model.load import load_model

    model = load_model(ModelSource(source=LLAMA, args={"size": "tiny"})).model
    outline = model_outline(model)
    assert outline.graph.total_numel == sum(p.numel() for p in model.parameters())
    assert "layers" in outline.containers and "Linear" in outline.torch_classes
    assert ModelOutline.from_dict(json.loads(json.dumps(outline.to_dict()))) == outline
    with pytest.raises(ValueError):
        ModelOutline.from_dict({**outline.to_dict(), "facts_version": -1})


def test_a_framework_plan_reads_the_facts_and_the_outline(cache, capsys, monkeypatch):
    """``--framework`` checks its plan against the model's outline: from the cache when both
    the facts and the outline are there (no tracing, the same plan), traced when the outline
    is missing."""
    flags = ("--mem", "3MB", "--framework", "accelerate")
    first = _plan(capsys, *flags)
    (outline,) = cache.glob("*.outline.json")
    outline.unlink()
    traced = []
    real = analyze.analyze_loaded
    monkeypatch.setattr(analyze, "analyze_loaded",
                        lambda *a, **k: traced.append(1) or real(*a, **k))
    assert _plan(capsys, *flags) == first
    assert traced and outline.exists()  # traced again, and the outline kept this time
    _no_tracing(monkeypatch)
    assert _plan(capsys, *flags) == first


def test_predict_verify_and_tune_read_the_facts_a_first_predict_wrote(cache, capsys, monkeypatch,
                                                                       tmp_path):
    """A plan predicted again (another GPU, a refitted hardware file) traces nothing: predict,
    verify and tune key the facts by the plan's own analysis options (its precision and
    selective stride), and --no-cache traces afresh and writes nothing. predict from cached
    facts builds no model and imports no torch, and still refuses a plan the kept outline
    does not match."""
    from fsdp_plan import api
    plan = tmp_path / "p.yaml"
    assert main([*ARGS, "--mem", "3MB", "--plan", str(plan), "-o", str(tmp_path / "p.py")]) == 0
    capsys.readouterr()
    planned = set(cache.iterdir())

    def predicted(*extra: str) -> dict:
        assert main(["predict", str(plan), "--format", "json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    first = predicted("--gpu", "a100")
    added = _facts_entries(cache)
    assert len(added) == len(_facts_entries_of(planned)) + 1  # the plan's options differ
    traced = []
    real = api.analyze_loaded
    monkeypatch.setattr(api, "analyze_loaded", lambda *a, **k: traced.append(1) or real(*a, **k))
    assert predicted("--gpu", "a100") == first and not traced
    assert predicted("--gpu", "h100")["predicted"] != first["predicted"] and not traced
    assert main(["verify", str(plan), "--format", "json"]) == 0 and not traced
    assert json.loads(capsys.readouterr().out)["ok"]
    before = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert predicted("--gpu", "a100", "--no-cache") == first and traced == [1]
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == before  # nothing written

    # from the cached facts and outline, predict builds no model and imports no torch
    code = ("import json, sys; from fsdp_plan.cli.main import main; "
            f"code = main(['predict', {str(plan)!r}, '--gpu', 'a100', '--format', 'json']); "
            "sys.stderr.write('TORCH ' + str('torch' in sys.modules) + '\\n'); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "TORCH False" in out.stderr and json.loads(out.stdout) == first
    # and the plan is still read against the model: a plan for another model is refused
    edited = plan.read_text().replace("\n  params: ", "\n  params: 1")
    assert edited != plan.read_text()
    other = tmp_path / "other.yaml"
    other.write_text(edited)
    assert main(["predict", str(other), "--format", "json"]) == 2
    assert "parameters but the plan was made for" in capsys.readouterr().err and traced == [1]


def _facts_entries_of(paths) -> list[Path]:
    return sorted(p for p in paths if not p.name.endswith(".outline.json"))
