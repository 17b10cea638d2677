"""The layer check (scripts/check_layers.py) as a ratchet, and the checker itself on a made-up package.

The package's violations today are listed in scripts/layers_allowlist.txt. The test fails on a violation not in
the list (a new cycle edge, upward import or in-function import without a ``# lazy:`` reason) and on a listed
entry that no longer occurs, so the list only shrinks.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "check_layers.py"


@pytest.fixture(scope="module")
def check_layers():
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_no_new_layer_violations_and_allowlist_only_shrinks(check_layers):
    report = check_layers.analyse(check_layers.collect())
    allowed = check_layers.read_allowlist()
    new = sorted(report.violations - allowed)
    gone = sorted(allowed - report.violations)
    assert not new, ("new layer violations (fix them; scripts/check_layers.py --list shows where):\n"
                     + "\n".join(new))
    assert not gone, ("fixed violations still allowlisted; delete these lines from "
                      "scripts/layers_allowlist.txt:\n" + "\n".join(gone))


def test_no_cycle_and_no_upward_import(check_layers):
    """The package's top-level parts import one way: no strongly connected parts, nothing reaching up a layer."""
    report = check_layers.analyse(check_layers.collect())
    assert report.cycles == [], f"import cycles between parts: {report.cycles}"
    assert [f"{i.path}:{i.line}" for i in report.upward] == []
    assert not any(v.startswith(("cycle ", "upward ")) for v in check_layers.read_allowlist())


def test_few_in_function_imports_each_with_its_reason(check_layers):
    """An import inside a function stays only to keep a heavy dependency out of a light command, or because it is
    optional; each says which with a ``# lazy:`` reason (``check_layers.py --list`` prints them)."""
    report = check_layers.analyse(check_layers.collect())
    assert len(report.in_function) <= 20, "\n".join(f"{i.path}:{i.line}" for i in report.in_function)
    assert [f"{i.path}:{i.line}" for i in report.in_function if i.reason is None] == []


def test_help_stays_light():
    """``dynabatch --help`` imports neither torch, transformers nor numba, and ``dynabatch train --help`` not torch:
    the lazy imports above are what keeps them so."""
    probe = ("import sys, runpy; sys.argv = ['dynabatch'] + sys.argv[1:]\n"
             "try:\n    runpy.run_module('dynabatch', run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('torch', 'transformers', 'numba') if m in sys.modules))")
    for argv, heavy in (([], set()), (["train"], {"transformers"})):
        done = subprocess.run([sys.executable, "-c", probe, *argv, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        imported = set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
        assert imported <= heavy, (argv, imported)


def test_every_part_has_a_layer(check_layers):
    report = check_layers.analyse(check_layers.collect())
    for imp in report.imports:
        assert check_layers.layer_of(imp.source) in check_layers.LAYERS
        assert check_layers.layer_of(imp.target) in check_layers.LAYERS


def test_script_exits_zero_and_prints_counts():
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "counts: internal_imports=" in done.stdout
    assert "parts_in_cycles=" in done.stdout and "in_function_imports=" in done.stdout


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_checker_finds_cycles_upward_and_unexplained_imports(check_layers, tmp_path):
    pkg = "dynabatch"
    _write(tmp_path, f"{pkg}/__init__.py", "")
    _write(tmp_path, f"{pkg}/data/__init__.py", "")
    _write(tmp_path, f"{pkg}/data/rows.py", "from dynabatch.plan import order\n")  # upward: data -> plan
    _write(tmp_path, f"{pkg}/plan/__init__.py", "")
    _write(tmp_path, f"{pkg}/plan/order.py", (
        "from ..data import rows\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from dynabatch.cost import tables\n"
        "def f():\n"
        "    import dynabatch.cost.tables  # lazy: keeps numba out of --help\n"
        "    from dynabatch.cost.tables import X\n"
        "    return X\n"))
    _write(tmp_path, f"{pkg}/cost/__init__.py", "")
    _write(tmp_path, f"{pkg}/cost/tables.py", "X = 1\n")
    imports = check_layers.collect(tmp_path)
    report = check_layers.analyse(imports)

    assert report.cycles == [["data", "plan"]]
    assert report.graph["plan"] == {"data", "cost"}
    assert "cycle data -> plan" in report.violations and "cycle plan -> data" in report.violations
    assert "upward data.rows -> plan.order" in report.violations
    # The relative import resolves to the submodule, at module level: no in-function entry.
    assert any(i.source == "plan.order" and i.target == "data.rows" and i.function is None for i in imports)
    # TYPE_CHECKING imports are type-only, not in-function.
    assert [i.type_only for i in imports if i.source == "plan.order" and i.function is None
            and i.target == "cost.tables"] == [True]
    lazy = sorted((i.line, i.reason) for i in report.in_function)
    assert lazy == [(6, "keeps numba out of --help"), (7, None)]
    assert "unexplained plan.order:f -> cost.tables" in report.violations
    assert check_layers.counts(report)["parts_in_cycles"] == 2
    assert check_layers.counts(report)["in_function_without_reason"] == 1


def test_layer_placement_uses_longest_prefix(check_layers, monkeypatch):
    assert check_layers.layer_of("training.trainer") == "training"
    assert check_layers.layer_of("engine.executor") == "engine"
    monkeypatch.setitem(check_layers.PLACEMENT, "engine.executor", "training")
    assert check_layers.layer_of("engine.executor.inner") == "training"
    assert check_layers.layer_of("engine.executor") == "training"
    assert check_layers.layer_of("engine.p2p") == "engine"
    assert check_layers.layer_of("cost.analytic") == "cost"
    with pytest.raises(KeyError):
        check_layers.layer_of("nowhere.module")


def test_unit_tests_are_filed_by_layer(check_layers):
    """``tests/unit`` mirrors the layers: one folder per layer of the package (``cli`` tests sit with
    ``commands``), plus ``project`` for checks of the repository as a whole; no test file loose at the top."""
    unit = ROOT / "tests" / "unit"
    folders = {p.name for p in unit.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders <= set(check_layers.LAYERS) | {"project"}, sorted(folders - set(check_layers.LAYERS))
    assert set(check_layers.LAYERS) - {"cli"} <= folders
    assert not sorted(unit.glob("test_*.py"))
