"""Check that dynabatch's layers import one way: print the part graph, cycles, upward and in-function imports.

Every module under ``dynabatch/`` is parsed with :mod:`ast` (nothing is imported). Each internal import
(``import dynabatch.x``, ``from dynabatch.x import y``, relative imports) is resolved to the module it names and
mapped twice:

- to a **part**: the package's top-level subpackage or module (``cost``, ``engine``, ``training``, ...). The
  part-level graph and its strongly connected components (cycles) are printed;
- to a **layer** of :data:`LAYERS`, the target order bottom to top. A module is placed by the longest prefix in
  :data:`PLACEMENT` (so a module can sit in another layer than the rest of its package). An import from a lower layer into a higher one is *upward*.

An internal import inside a function (or method) is *in-function*; it is explained by a trailing
``# lazy: <reason>`` comment on the import's line(s), else it reads "no reason". Imports under
``if TYPE_CHECKING:`` are type-only: they appear in the graph but are not counted as in-function.

The rules: no edge inside a cycle, no upward import (at module level or in a function), no in-function import
without a reason. Today's violations are listed in ``scripts/layers_allowlist.txt``; the script exits 1 on any violation that is not in the allowlist and on any allowlisted entry that no longer occurs (so
the list only shrinks: delete the line when its violation is fixed). ``--no-allowlist`` reports every violation.

Usage: ``python scripts/check_layers.py [--graph] [--list] [--no-allowlist] [--prune]`` (tests/unit/project/test_layers.py runs it).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dynabatch"
ALLOWLIST = Path(__file__).resolve().parent / "layers_allowlist.txt"

LAYERS: tuple[str, ...] = (
    "core", "data", "cost", "plan", "schedule", "models", "engine", "training", "integrations", "commands", "cli",
)
"""The target layers, bottom to top: each may import only from layers below it (and itself).

- ``core``: torch-free names, registries and small types shared by all;
- ``data``: mixtures, tokenizing, lengths, global batches, baseline batchers;
- ``cost``: profiles, tables, the analytic model, the online fit;
- ``plan``: ordering, partition DP, token slices, dealing to replicas;
- ``schedule``: policies, simulator, placement, lowering to per-rank instructions, validator;
- ``models``: model families, stage modules, attention paths;
- ``engine``: the pipeline engine (process groups, p2p, delivery, executor, checkpoint I/O, launch);
- ``training``: the training application (loop, planner service, calibration, layout choice, evaluation, metrics,
  tracking, its configuration);
- ``integrations``: Hugging Face DataLoader and Trainer;
- ``commands`` and ``cli``: every command, the top of the house.
"""

PLACEMENT: dict[str, str] = {
    "__init__": "core",
    "core": "core",
    "sequence": "core",
    "model_presets": "core",
    "data": "data",
    "cost": "cost",
    "plan": "plan",
    "schedule": "schedule",
    "models": "models",
    "engine": "engine",
    "training": "training",
    "integrations": "integrations",
    "commands": "commands",
    "cli": "cli",
    "__main__": "cli",
}
"""Where today's modules sit in :data:`LAYERS`: a module (without the ``dynabatch.`` prefix) takes the layer of
its longest listed prefix. The engine and the application are separate packages: ``engine`` and ``training``
(which holds the training configuration, ``training.config``, and ``training.workload``, the
plan/simulate/bench planning path over a ``TrainConfig``-like view)."""

LAZY_TAG = "# lazy:"


@dataclass(frozen=True)
class Import:
    """One internal import statement (one per imported module)."""

    source: str
    """Importing module, without the package prefix (``cost.analytic``; ``__init__`` for the package)."""
    target: str
    """Imported module, without the package prefix."""
    path: str
    """File of the importing module, relative to the repository root."""
    line: int
    function: str | None
    """Qualified name of the enclosing function, or ``None`` at module (or class) level."""
    type_only: bool
    """Under ``if TYPE_CHECKING:``."""
    reason: str | None
    """The ``# lazy: <reason>`` text, if any."""

    @property
    def source_part(self) -> str:
        return self.source.split(".")[0]

    @property
    def target_part(self) -> str:
        return self.target.split(".")[0]


def layer_of(module: str) -> str:
    """The layer of ``module`` (without the package prefix), by longest prefix in :data:`PLACEMENT`."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        key = ".".join(parts[:end])
        if key in PLACEMENT:
            return PLACEMENT[key]
    raise KeyError(f"{module!r} has no place in PLACEMENT; add its top-level part to scripts/check_layers.py")


def _module_names(package_dir: Path) -> dict[str, Path]:
    """Every module under the package: name without the package prefix -> file."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1] or ["__init__"]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    """Walks one module, recording internal imports with their function and TYPE_CHECKING context."""

    def __init__(self, module: str, is_package: bool, path: str, lines: list[str], modules: set[str]):
        self.module, self.is_package, self.path = module, is_package, path
        self.lines, self.modules = lines, modules
        self.stack: list[str] = []
        self.functions = 0
        self.type_only = 0
        self.found: list[Import] = []

    def visit_FunctionDef(self, node):  # noqa: N802
        self.stack.append(node.name)
        self.functions += 1
        self.generic_visit(node)
        self.functions -= 1
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):  # noqa: N802
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_If(self, node):  # noqa: N802
        if _is_type_checking(node.test):
            self.type_only += 1
            for child in node.body:
                self.visit(child)
            self.type_only -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _resolve(self, name: str) -> str | None:
        """``name`` (absolute, with the package prefix stripped) as a known module, or its longest known prefix."""
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in self.modules:
                return candidate
        return None

    def _record(self, node: ast.stmt, target: str) -> None:
        text = " ".join(self.lines[node.lineno - 1:node.end_lineno])
        reason = None
        if LAZY_TAG in text:
            reason = text.split(LAZY_TAG, 1)[1].strip() or None
        self.found.append(Import(
            source=self.module, target=target, path=self.path, line=node.lineno,
            function=".".join(self.stack) if self.functions else None, type_only=self.type_only > 0,
            reason=reason))

    def visit_Import(self, node):  # noqa: N802
        for alias in node.names:
            if alias.name == PACKAGE:
                self._record(node, "__init__")
            elif alias.name.startswith(PACKAGE + "."):
                target = self._resolve(alias.name[len(PACKAGE) + 1:])
                if target is not None:
                    self._record(node, target)

    def visit_ImportFrom(self, node):  # noqa: N802
        if node.level:
            here = [] if self.module == "__init__" else self.module.split(".")
            base_parts = here if self.is_package else here[:-1]
            if node.level > 1:
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        elif node.module == PACKAGE:
            base = ""
        elif node.module and node.module.startswith(PACKAGE + "."):
            base = node.module[len(PACKAGE) + 1:]
        else:
            return
        targets = set()
        for alias in node.names:
            full = f"{base}.{alias.name}" if base else alias.name
            if full in self.modules:
                targets.add(full)  # ``from pkg import submodule``
            elif base:
                resolved = self._resolve(base)
                if resolved is not None:
                    targets.add(resolved)
            else:
                targets.add("__init__")  # ``from dynabatch import __version__``
        for target in sorted(targets):
            self._record(node, target)


def collect(root: Path = ROOT) -> list[Import]:
    """Every internal import of the package under ``root``."""
    package_dir = root / PACKAGE
    modules = _module_names(package_dir)
    found: list[Import] = []
    for module, path in modules.items():
        source = path.read_text()
        collector = _Collector(module, path.name == "__init__.py", str(path.relative_to(root)),
                               source.splitlines(), set(modules))
        collector.visit(ast.parse(source, filename=str(path)))
        found.extend(collector.found)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` with more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


@dataclass
class Report:
    """What :func:`analyse` finds: the part graph, its cycles, and the rule-breaking imports as entries."""

    imports: list[Import]
    graph: dict[str, set[str]]
    cycles: list[list[str]]
    violations: set[str]
    """Allowlist-style entries: ``cycle A -> B``, ``upward S -> T``, ``unexplained S:f -> T``."""
    upward: list[Import]
    in_function: list[Import]


def analyse(imports: list[Import]) -> Report:
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        graph.setdefault(imp.source_part, set())
        graph.setdefault(imp.target_part, set())
        if imp.source_part != imp.target_part:
            graph[imp.source_part].add(imp.target_part)
    cycles = strongly_connected(graph)
    violations: set[str] = set()
    for component in cycles:
        members = set(component)
        for src in component:
            for dst in graph[src] & members:
                violations.add(f"cycle {src} -> {dst}")
    upward = [imp for imp in imports
              if LAYERS.index(layer_of(imp.source)) < LAYERS.index(layer_of(imp.target))]
    for imp in upward:
        violations.add(f"upward {imp.source} -> {imp.target}")
    in_function = [imp for imp in imports if imp.function is not None]
    for imp in in_function:
        if imp.reason is None:
            violations.add(f"unexplained {imp.source}:{imp.function} -> {imp.target}")
    return Report(imports, dict(graph), cycles, violations, upward, in_function)


def read_allowlist(path: Path = ALLOWLIST) -> set[str]:
    """The allowlisted entries: one per line, ``#`` starts a comment."""
    if not path.exists():
        return set()
    entries = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            entries.add(line)
    return entries


def counts(report: Report) -> dict[str, int]:
    """The figures the issue tracks."""
    return {
        "internal_imports": len(report.imports),
        "parts": len(report.graph),
        "parts_in_cycles": sum(len(c) for c in report.cycles),
        "cycle_edges": sum(1 for v in report.violations if v.startswith("cycle ")),
        "upward_imports": len(report.upward),
        "in_function_imports": len(report.in_function),
        "in_function_without_reason": sum(1 for imp in report.in_function if imp.reason is None),
    }


def _print_report(report: Report, show_graph: bool, show_list: bool) -> None:
    if show_graph:
        print("part-level import graph (part -> parts it imports):")
        for part in sorted(report.graph):
            print(f"  {part:14s} [{layer_of(part)}] -> {', '.join(sorted(report.graph[part])) or '-'}")
    print(f"cycles (strongly connected parts): {len(report.cycles)}")
    for component in report.cycles:
        print(f"  {len(component)} parts: {', '.join(component)}")
    if show_list:
        print(f"upward imports: {len(report.upward)}")
        for imp in sorted(report.upward, key=lambda i: (i.path, i.line)):
            where = f" in {imp.function}()" if imp.function else ""
            print(f"  {imp.path}:{imp.line}{where}: {imp.source} [{layer_of(imp.source)}] -> "
                  f"{imp.target} [{layer_of(imp.target)}]")
        print(f"in-function imports: {len(report.in_function)}")
        for imp in sorted(report.in_function, key=lambda i: (i.path, i.line)):
            print(f"  {imp.path}:{imp.line} in {imp.function}(): {imp.target} -- {imp.reason or 'no reason'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", action="store_true", help="print the part-level import graph")
    parser.add_argument("--list", action="store_true",
                        help="list every upward and every in-function import with its reason")
    parser.add_argument("--no-allowlist", action="store_true",
                        help="judge every violation, ignoring scripts/layers_allowlist.txt")
    parser.add_argument("--write-allowlist", action="store_true",
                        help="write today's violations to scripts/layers_allowlist.txt (to start the ratchet)")
    parser.add_argument("--prune", action="store_true",
                        help="delete allowlisted entries that no longer occur (the list only shrinks; adds nothing)")
    args = parser.parse_args(argv)

    report = analyse(collect())
    _print_report(report, args.graph or not args.write_allowlist, args.list)
    figures = counts(report)
    print("counts: " + ", ".join(f"{k}={v}" for k, v in figures.items()))

    if args.write_allowlist:
        lines = ["# Today's layer violations (scripts/check_layers.py). This list only shrinks: fix one, delete",
                 "# its line. check_layers fails on a violation not listed here and on a listed one that is gone."]
        ALLOWLIST.write_text("\n".join(lines + sorted(report.violations)) + "\n")
        print(f"wrote {len(report.violations)} entries to {ALLOWLIST.relative_to(ROOT)}")
        return 0

    if args.prune:
        kept = [line for line in ALLOWLIST.read_text().splitlines()
                if not line.split("#", 1)[0].strip() or line.split("#", 1)[0].strip() in report.violations]
        ALLOWLIST.write_text("\n".join(kept) + "\n")
    allowed = set() if args.no_allowlist else read_allowlist()
    new = sorted(report.violations - allowed)
    gone = sorted(allowed - report.violations)
    print(f"violations: {len(report.violations)} ({len(report.violations & allowed)} allowlisted), "
          f"new: {len(new)}, allowlisted but gone: {len(gone)}")
    for entry in new:
        print(f"  NEW {entry}")
    for entry in gone:
        print(f"  GONE {entry} (delete it from {ALLOWLIST.relative_to(ROOT)})")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main())
