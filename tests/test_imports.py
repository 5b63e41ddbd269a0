"""The package's import graph has no circle (issue 22): every module's imports, at the top
and inside functions, read from its source, resolved within ulysses_jax, and searched for a
strongly connected component of more than one module. A family's block class is named in
models/families.py and imported when a model is built, so the registry is a leaf."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "ulysses_jax")


def _modules() -> dict[str, str]:
    mods = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return mods


def _edges(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from . import x`` is an edge to x, not
    to the package; ``from .pkg import name`` to pkg's __init__ unless name is a module)."""
    edges = {}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rsplit(".", 1)[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level \
                    else node.module
                subs = {f"{target}.{a.name}" for a in node.names} & set(mods)
                out |= subs
                if target in mods and len(subs) < len(node.names):
                    out.add(target)
        edges[mod] = out - {mod}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_circle():
    """The check itself: a circle of two modules is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_in_the_package():
    mods = _modules()
    edges = _edges(mods)
    assert len(mods) > 40 and "ulysses_jax.models.decoder" in mods
    assert "ulysses_jax.models.layers" in edges["ulysses_jax.models.decoder"]  # edges are read
    assert _cycles(edges) == []
