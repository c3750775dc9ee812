"""A fresh install (``pip install -e .``, no extras) has every package the code imports.

Issue 8.1: on a machine without NumPy, ``python3 -m pytest -q`` failed at collection and
every ``fsdp-plan bench`` rank crashed (``CommDebugMode``'s package imports ``numpy``), and
every command printed PyTorch's "Failed to initialize NumPy" warning: torch does not require
NumPy, so nothing installed it. Two checks:

- statically, every ``import``/``from`` in ``fsdp_plan/**/*.py`` (module level or inside a
  function) names the standard library, ``fsdp_plan`` or a declared base dependency; the
  optional extra (``transformers``) only inside functions of ``fsdp_plan/model/hf.py``;
- dynamically, importing every module the package names loads only distributions that a
  fresh install brings: the declared dependencies and, recursively, what they require
  (extras excluded). This is the check that sees ``torch.distributed.tensor.debug`` pull in
  NumPy.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdp_plan"
OPTIONAL = {"transformers": ("fsdp_plan/model/hf.py",),
            # the frameworks extra: `fsdp-plan export` writes their files as text and never
            # imports them; only the tests marked `frameworks` read the files with them
            "accelerate": None, "lightning": None, "pytorch_lightning": None, "triton": None,
            # torchtitan's own models are planned by name: built by this one factory module
            "torchtitan": ("fsdp_plan/model/torchtitan_models.py",),
            # the html extra: --html draws with plotly, imported in these modules only
            "plotly": ("fsdp_plan/pictures/html.py", "fsdp_plan/pictures/trace_page.py")}
"""Import name of each optional extra -> the modules allowed to import it (lazily, inside a
function), or None when no module of the package may import it."""


def _pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        return tomllib.loads(text)
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.DOTALL | re.MULTILINE)
    return {"project": {"dependencies": re.findall(r'"([^"]+)"', block.group(1))}}


def _dist_name(requirement: str) -> str:
    """``'numpy>=1.22; python_version>"3"'`` -> ``'numpy'`` (PEP 503 normalised)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies() -> set[str]:
    return {_dist_name(r) for r in _pyproject()["project"]["dependencies"]}


def _import_names(dist: str) -> set[str]:
    """Top-level import names a distribution provides (``pyyaml`` -> ``yaml``)."""
    names = {top for top, dists in metadata.packages_distributions().items()
             if dist in {_dist_name(d) for d in dists}}
    return names or {dist.replace("-", "_")}


def _marker_applies(requirement: str) -> bool:
    """A requirement a plain install brings: no ``extra ==`` marker (others taken as true)."""
    _, _, marker = requirement.partition(";")
    return "extra" not in marker


def installed_closure(roots: set[str]) -> set[str]:
    """The distributions a fresh install of ``roots`` brings (their requirements, recursively)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_dist_name(r) for r in requires if _marker_applies(r)]
    return seen


def package_imports() -> list[tuple[str, str, int, bool]]:
    """Every absolute import in the package: (module name, file, line, inside a function)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        lazy_lines: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                lazy_lines |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            rel = str(path.relative_to(ROOT))
            found += [(name, rel, node.lineno, node.lineno in lazy_lines) for name in names]
    return found


def test_every_import_is_stdlib_the_package_or_a_declared_dependency():
    allowed = set(sys.stdlib_module_names) | {"fsdp_plan", "__future__"}
    for dist in declared_dependencies():
        allowed |= _import_names(dist)
    problems = []
    for name, where, line, lazy in package_imports():
        top = name.split(".")[0]
        if top in OPTIONAL:
            if OPTIONAL[top] is None:
                problems.append(f"{where}:{line} imports the optional {top!r}, which the "
                                "package never needs (its files are written as text)")
            elif where not in OPTIONAL[top] or not lazy:
                problems.append(f"{where}:{line} imports the optional {top!r} "
                                f"(only {', '.join(OPTIONAL[top])} may, inside a function)")
        elif top not in allowed:
            problems.append(f"{where}:{line} imports {name!r}, which is neither the standard "
                            "library nor a dependency declared in pyproject.toml")
    assert not problems, "\n".join(problems)


def test_the_scan_sees_lazy_imports_and_the_optional_extra():
    """The scan itself can fail: it finds the lazy ``transformers`` import in hf.py."""
    imports = package_imports()
    assert any(n.startswith("transformers") and w == "fsdp_plan/model/hf.py" and lazy
               for n, w, _, lazy in imports)
    assert any(n == "torch" and not lazy for n, _, _, lazy in imports)
    assert "numpy" in declared_dependencies()


_LOADER = r"""
import importlib, json, pkgutil, sys, warnings

BLOCKED = set(json.loads(sys.argv[2]))


class Hidden:
    # Every finder, minus the distributions a fresh install lacks: they are simply not found.

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


for loaded in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[loaded]
sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
warnings.simplefilter("error", UserWarning)  # torch's "Failed to initialize NumPy" is one
import fsdp_plan
names = [m.name for m in pkgutil.walk_packages(fsdp_plan.__path__, "fsdp_plan.")]
for name in names + json.loads(sys.argv[1]):
    importlib.import_module(name)
"""


@pytest.mark.slow
def test_importing_everything_works_with_only_what_a_fresh_install_brings():
    """In a fresh interpreter that cannot see the distributions a base install lacks, import
    every package module and every module the package names (lazy imports too), with
    warnings as errors. Before NumPy was declared, ``torch.distributed.tensor.debug``
    needed it (neither we nor torch required it) and this failed; optional imports that
    libraries try and skip (tabulate's wcwidth) stay harmless, as on a user's machine."""
    named = sorted({n for n, _, _, _ in package_imports()
                    if n.split(".")[0] not in OPTIONAL and n.split(".")[0] != "fsdp_plan"})
    brought = installed_closure(declared_dependencies())
    stdlib = set(sys.stdlib_module_names)
    blocked = sorted(top for top, dists in metadata.packages_distributions().items()
                     if top not in stdlib and top != "fsdp_plan"
                     and not {_dist_name(d) for d in dists} & brought)
    for extra in ("transformers", "accelerate", "lightning", "torchtitan"):
        assert extra in blocked or extra not in metadata.packages_distributions(), extra
    done = subprocess.run([sys.executable, "-c", _LOADER, json.dumps(named), json.dumps(blocked)],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, ("importing the package failed with only the declared "
                                  "dependencies (declare what is missing in pyproject.toml):\n"
                                  + done.stderr[-3000:])
    assert "NumPy" not in done.stderr, done.stderr
