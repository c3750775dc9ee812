"""The package's shape (issue 8): no import cycle, the command line on top of the library."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_plan"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``"""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__")


def imports(path: Path, *, module_level_only: bool) -> set[str]:
    """fsdp_plan modules ``path`` imports (``from fsdp_plan.x import y`` names ``fsdp_plan.x``,
    or ``fsdp_plan.x.y`` when that is a module).

    An ``if __name__ == "__main__":`` block is left out: it runs only when the file is started
    as a program (``python -m fsdp_plan.bench.gpu_check``), as the top of its own import chain,
    so it takes part in no cycle; it must still not reach up into the command line
    (``test_no_main_block_outside_the_command_line_imports_it``)."""
    tree = ast.parse(path.read_text())
    body = [node for node in tree.body if not _is_main_guard(node)]
    nodes = body if module_level_only else [n for top in body for n in ast.walk(top)]
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_plan"):
            found.add(node.module)
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists():
                    found.add(candidate)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("fsdp_plan")}
    return found


def graph(module_level_only: bool) -> nx.DiGraph:
    g = nx.DiGraph()
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        g.add_node(name)
        for target in imports(path, module_level_only=module_level_only):
            if target != name and not name.startswith(target + "."):
                g.add_edge(name, target)
    # importing a submodule imports its package first: that is not a dependency on it
    return g


def test_module_level_imports_have_no_cycle():
    cycles = list(nx.simple_cycles(graph(module_level_only=True)))
    assert not cycles, cycles[:5]


def test_no_cycle_counting_imports_inside_functions():
    """An import written inside a function still makes its module depend on the other one: a
    cycle hidden that way is a cycle (issue 17)."""
    cycles = sorted(nx.simple_cycles(graph(module_level_only=False)), key=len)
    assert not cycles, cycles[:5]


def _imports_torch_at_module_level(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any((isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch"
                                                     for a in node.names))
               or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0]
                   == "torch") for node in tree.body)


def _path_of(module: str) -> Path:
    path = PACKAGE.parent / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_help_and_flag_checks_come_before_torch():
    """``fsdp-plan --help`` and every flag check run before the ~6 s torch import: the command
    line's entry, the plan verb and the verbs that defer their torch work to ``run()``
    (predict, calibrate, emit) import no torch at module level, however deep; the
    other verbs, which do, are imported by name only when named (``VERBS``)."""
    from fsdp_plan.cli.main import PLAN_VERB, VERBS

    g = graph(module_level_only=True)
    light = ("fsdp_plan.cli.main", PLAN_VERB, VERBS["predict"], VERBS["calibrate"],
             VERBS["emit"])
    for module in light:
        torch_users = [m for m in nx.descendants(g, module) | {module}
                       if _imports_torch_at_module_level(_path_of(m))]
        assert not torch_users, (module, torch_users)
    for module in light[1:]:
        assert module == PLAN_VERB or module in VERBS.values()


def test_no_module_outside_the_command_line_imports_it():
    """The command line parses and prints; the library (api.py and below) never calls it."""
    g = graph(module_level_only=False)
    offenders = [(a, b) for a, b in g.edges
                 if b.startswith("fsdp_plan.cli") and not a.startswith("fsdp_plan.cli")]
    assert not offenders, offenders


def _names_the_command_line(node: ast.AST) -> bool:
    """An import of ``fsdp_plan.cli`` or one of its modules, in any spelling: ``import
    fsdp_plan.cli.x``, ``from fsdp_plan.cli.x import y``, ``from fsdp_plan import cli``, or the
    module's name as a string (``importlib.import_module``, ``runpy.run_module``)."""
    def is_cli(name: str) -> bool:
        return name == "fsdp_plan.cli" or name.startswith("fsdp_plan.cli.")
    if isinstance(node, ast.Import):
        return any(is_cli(a.name) for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return is_cli(node.module or "") or (node.module == "fsdp_plan"
                                             and any(a.name == "cli" for a in node.names))
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and is_cli(
        node.value.split(":")[0])


def test_no_main_block_outside_the_command_line_imports_it():
    """The exemption of ``if __name__ == "__main__":`` blocks from the cycle checks hides no
    upward arrow: a library module started as a program (``python -m fsdp_plan.bench.gpu_check``)
    does not hand over to the command line. The torchrun bench entry is a command-line module
    (cli/bench_worker.py); it was ``bench/worker.py``'s main block importing ``cli/bench.py``
    (issue 28 item 4)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "cli":
            continue
        for top in ast.parse(path.read_text()).body:
            if _is_main_guard(top):
                offenders += [(module_name(path), node.lineno) for node in ast.walk(top)
                              if _names_the_command_line(node)]
    assert not offenders, offenders


def test_the_main_block_check_sees_the_old_circle():
    """The check above fails on the block it was written against (a test that can fail)."""
    old = ast.parse('if __name__ == "__main__":\n'
                    '    from fsdp_plan.cli.bench import torchrun_main\n'
                    '    sys.exit(torchrun_main())\n').body[0]
    assert _is_main_guard(old)
    assert any(_names_the_command_line(node) for node in ast.walk(old))
    for spelling in ("import fsdp_plan.cli.bench", "from fsdp_plan import cli",
                     "runpy.run_module('fsdp_plan.cli.bench_worker')"):
        assert any(_names_the_command_line(n) for n in ast.walk(ast.parse(spelling))), spelling
    assert not any(_names_the_command_line(n)
                   for n in ast.walk(ast.parse("from fsdp_plan.client import x")))


def test_the_plan_command_uses_the_library_api():
    assert "fsdp_plan.api" in imports(PACKAGE / "cli" / "plan.py", module_level_only=False)
    assert "fsdp_plan.api" in imports(PACKAGE / "cli" / "predict.py", module_level_only=False)


README = PACKAGE.parent / "README.md"


def _how_it_works_rows() -> dict[str, set[str]]:
    """README's "How it works" table: subpackage folder -> the module files its row names."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## How it works", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`"):
            continue
        folder = cells[1].strip("`").rstrip("/")
        named = set(re.findall(r"`([A-Za-z_/]+(?:\.py|/))`", cells[2]))
        rows.setdefault(folder, set()).update(named)
    return rows


def test_readme_has_no_merge_markers():
    text = README.read_text(encoding="utf-8")
    for marker in ("<<<<<<< ", "\n=======\n", ">>>>>>> "):
        assert marker not in text, f"README.md holds an unresolved merge marker {marker!r}"


def test_readme_module_table_matches_the_tree():
    """Each subpackage row of README's "How it works" names modules that exist, and every
    module of that subpackage is named (a module table that drifted from the tree is how a
    newcomer gets lost: issue 31, S4-18)."""
    rows = _how_it_works_rows()
    subpackages = sorted(p.name for p in PACKAGE.iterdir()
                         if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(k for k in rows if "/" not in k and not k.endswith(".py")) == subpackages
    for folder, named in rows.items():
        if folder.endswith(".py"):
            continue
        base = PACKAGE / folder
        for name in named:
            target = PACKAGE.parent / name if name.startswith("fsdp_plan/") else base / name
            assert target.exists(), f"README names {folder}/{name}, which is not in the tree"
        present = {p.name for p in base.glob("*.py") if p.name != "__init__.py"}
        present |= {p.name + "/" for p in base.iterdir()
                    if p.is_dir() and (p / "__init__.py").exists()}
        missing = sorted(present - named)
        assert not missing, f"README's {folder}/ row does not name {missing}"


def test_the_plan_fields_are_declared_once():
    """plan/schema.py ``FIELDS`` is the one list of a plan's top-level keys (DESIGN 0, issue
    28): the ``Plan`` dataclass holds exactly those attributes in that order, and no module
    writes the list out again: no other list or tuple of string literals names more than a
    few of them (the writer's order and ``from_dict``'s arguments are derived from it)."""
    from dataclasses import fields

    from fsdp_plan.plan.document import Plan
    from fsdp_plan.plan.schema import FIELDS

    names = [f.name for f in FIELDS]
    assert [f.name for f in fields(Plan)] == names
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "schema.py" and path.parent.name == "plan":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                named = {e.value for e in node.elts if isinstance(e, ast.Constant)
                         and isinstance(e.value, str)} & set(names)
                if len(named) > 5:
                    offenders.append((str(path.relative_to(PACKAGE)), node.lineno, len(named)))
    assert not offenders, offenders


def test_each_typed_section_reads_back_what_it_writes():
    """A plan's typed sections (plan/sections/) are each declared once: the dataclass is the
    list of its keys, and the schema's checker of that field turns the section's own
    ``to_dict`` back into an equal section, so a section read, re-written and read again is the
    same (issue 28). A section's keys spelled out anew beside the dataclass would drift."""
    from dataclasses import fields

    from fsdp_plan.cost.ddp_buckets import DDPConfig
    from fsdp_plan.plan.checker import Checker
    from fsdp_plan.plan.schema import FIELDS
    from fsdp_plan.plan.sections import (
        MODEL_KEYS,
        CompiledBlocks,
        ModelRecipe,
        Offload,
        PlanPrecision,
    )

    assert MODEL_KEYS == tuple(f.name for f in fields(ModelRecipe))
    by_name = {f.name: f for f in FIELDS}
    examples = {
        "model": ModelRecipe(source="examples/llama.py", entry="build_model",
                             args={"size": "8b"}, batch_size=2, seq_len=128, kind="file",
                             params=10, digest="d", notes=("a note",)),
        "mixed_precision": PlanPrecision(param_dtype="float32", reduce_dtype="float32",
                                         autocast_dtype="bfloat16"),
        "ddp": DDPConfig(bucket_cap_mb=50, first_bucket_mb=2, static_graph=True,
                         comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=10),
        "offload": Offload(),
        "compile": CompiledBlocks(modules=("layers.0", "layers.1"), activation_memory_budget=0.5),
    }
    context = {"strategy": "ddp", "world_size": 8}
    for name, section in examples.items():
        checked = by_name[name].check(Checker("plan"), section.to_dict(), context)
        assert checked == section, name


def test_the_plan_checkers_stay_small():
    """plan/check.py held every section's checker (809 lines before issue 28); the typed
    sections took theirs to plan/sections/. It stays under half of what it was."""
    assert len((PACKAGE / "plan" / "check.py").read_text().splitlines()) < 405
