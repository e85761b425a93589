"""The package has no import cycles.

The import graph is built from the source with ``ast``, as a reader would: every ``import`` and
``from ... import`` anywhere in a module (also inside functions) is an edge; ``from pkg import
name`` is an edge to ``pkg`` and, when ``pkg.name`` is a module, to it too; an import of a module
that does not exist here is an edge to its nearest existing parent package. Cycles are the strongly
connected components with more than one module (Tarjan).
"""

from __future__ import annotations

import ast
import os

import sglang

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__)))  # .../python
PACKAGE = "sglang.multimodal_gen"


def _modules(root: str) -> dict[str, str]:
    """``{dotted module name: file}`` of every ``.py`` file under ``root/sglang``."""
    mods = {}
    for d, _, files in os.walk(os.path.join(root, "sglang")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for the package source under ``root``."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in names:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != m:
                    graph[m].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        cycles.append(component)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def test_the_check_finds_a_cycle():
    """A package whose submodule imports the package back is a cycle (the check can fail)."""
    graph = {"p": {"p.a"}, "p.a": {"p"}, "q": set()}
    assert import_cycles(graph) == [{"p", "p.a"}]


def test_the_hub_lookup_is_below_its_users():
    """The LoRA loader finds Hub ids through ``hub`` (not the server's arguments), and ``hub``
    imports nothing of the package."""
    graph = import_graph()
    for module, targets in graph.items():
        if module == f"{PACKAGE}.lora" or module.startswith(f"{PACKAGE}.lora."):
            assert f"{PACKAGE}.configs.server_args" not in targets, module
    assert not {t for t in graph[f"{PACKAGE}.hub"] if t.startswith(PACKAGE)}


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [{"a", "b", "c"}]
