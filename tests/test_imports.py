"""The package's import graph reads bottom-up: every module's imports, at the top and inside
functions, read from its source and resolved within ulysses_jax, form no circle (a strongly
connected component of more than one module), and none runs from a lower layer into a higher
one (``LAYERS``, written once here). The training loop holds no data code: no module under
training/ imports a tokenizer, a file-format or an image library."""
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


# The layers, bottom first. A module belongs to the layer of the longest name below that is
# itself or one of its packages; it may import from its own layer and the ones before it.
LAYERS = (
    ("bottom", ("ulysses_jax.mesh", "ulysses_jax.hlo", "ulysses_jax.memory", "ulysses_jax.config",
                "ulysses_jax.model_config", "ulysses_jax.families", "ulysses_jax.head_layout",
                "ulysses_jax.compile_cache", "ulysses_jax.time_model")),
    ("attention", ("ulysses_jax.attention",)),
    ("models", ("ulysses_jax.models", "ulysses_jax.gpu_target")),
    ("generation", ("ulysses_jax.generation",)),
    ("interop", ("ulysses_jax.interop",)),
    ("data", ("ulysses_jax.data",)),
    ("training", ("ulysses_jax.training",)),
    ("runs", ("ulysses_jax.runs",)),
    ("CLIs", ("ulysses_jax", "ulysses_jax.data.__main__", "ulysses_jax.evaluate",
              "ulysses_jax.export", "ulysses_jax.generate", "ulysses_jax.plan",
              "ulysses_jax.plot", "ulysses_jax.compare", "ulysses_jax.hf")),
)
# The command-line tools that open a run or a Hugging Face directory: each reads it through
# ulysses_jax.runs and none imports another.
LOADING_CLIS = ("ulysses_jax.evaluate", "ulysses_jax.export", "ulysses_jax.generate")
# Libraries that read, tokenize or decode data: the data package's, never the loop's.
DATA_LIBRARIES = ("tokenizers", "pyarrow", "PIL", "jinja2", "transformers")


def _layer(mod: str, layers=LAYERS) -> int:
    """Index of ``mod``'s layer (the longest matching name wins)."""
    best = None
    for i, (_, names) in enumerate(layers):
        for name in names:
            if mod == name or mod.startswith(name + ".") and name != "ulysses_jax":
                if best is None or len(name) > best[0]:
                    best = (len(name), i)
    if mod == "ulysses_jax":
        best = best or (0, len(layers) - 1)
    assert best is not None, f"{mod} is in no layer of LAYERS: place it there"
    return best[1]


def _upward(edges: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import from a lower layer into a higher one, as 'a (layer) -> b (layer)'."""
    found = []
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            la, lb = _layer(a, layers), _layer(b, layers)
            if lb > la:
                found.append(f"{a} ({layers[la][0]}) -> {b} ({layers[lb][0]})")
    return found


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


def test_the_layer_check_sees_an_import_up():
    """The check itself: an import into a higher layer is found, one into a lower or the same
    layer is not, and the longest name decides the layer."""
    layers = (("low", ("ulysses_jax.a",)), ("high", ("ulysses_jax.b", "ulysses_jax.a.cli")))
    assert _layer("ulysses_jax.a.x", layers) == 0 and _layer("ulysses_jax.a.cli", layers) == 1
    assert _upward({"ulysses_jax.a.x": {"ulysses_jax.b.y"}}, layers) == [
        "ulysses_jax.a.x (low) -> ulysses_jax.b.y (high)"]
    assert _upward({"ulysses_jax.b.y": {"ulysses_jax.a.x"},
                    "ulysses_jax.a.x": {"ulysses_jax.a.z"},
                    "ulysses_jax.a.cli": {"ulysses_jax.b.y"}}, layers) == []


def test_no_import_runs_up_a_layer():
    mods = _modules()
    edges = _edges(mods)
    layer = {m: LAYERS[_layer(m)][0] for m in mods}  # every module is placed (asserts)
    assert layer["ulysses_jax.config"] == "bottom" and layer["ulysses_jax.data.store"] == "data"
    assert layer["ulysses_jax.data.__main__"] == "CLIs"
    assert "ulysses_jax.families" in edges["ulysses_jax.config"]
    assert _upward(edges) == []


def _among(edges: dict[str, set[str]], group) -> list[str]:
    """Every import from one module of ``group`` into another, as 'a -> b'."""
    return sorted(f"{a} -> {b}" for a in group for b in edges.get(a, ()) if b in group)


def test_the_cli_check_sees_one_cli_importing_another(tmp_path):
    """The check itself: an import of one CLI by another inside a function is found; one of
    the shared loader is not."""
    package = tmp_path / "ulysses_jax"
    package.mkdir()
    sources = {"__init__": "", "runs": "def load(): pass\n",
               "evaluate": "from .runs import load\n",
               "export": "def main():\n    from . import runs\n",
               "generate": "def generate():\n    from .evaluate import load\n"}
    for name, text in sources.items():
        (package / f"{name}.py").write_text(text)
    mods = {("ulysses_jax" if n == "__init__" else f"ulysses_jax.{n}"): str(package / f"{n}.py")
            for n in sources}
    edges = _edges(mods)
    assert edges["ulysses_jax.export"] == {"ulysses_jax.runs"}
    assert _among(edges, LOADING_CLIS) == ["ulysses_jax.generate -> ulysses_jax.evaluate"]


def test_the_clis_import_none_of_one_another():
    """evaluate, export and generate open runs through ulysses_jax.runs, and none imports
    another (at the top or inside a function)."""
    edges = _edges(_modules())
    for cli in LOADING_CLIS:
        assert "ulysses_jax.runs" in edges[cli], cli
    assert _among(edges, LOADING_CLIS) == []


def test_the_training_loop_holds_no_data_code():
    """No module under training/ imports a library that reads, tokenizes or decodes data."""
    checked = 0
    for mod, path in _modules().items():
        if not mod.startswith("ulysses_jax.training."):
            continue
        checked += 1
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad = [n for n in names if n.split(".")[0] in DATA_LIBRARIES]
            assert not bad, f"{mod} imports {bad}: data code belongs in ulysses_jax/data/"
    assert checked >= 8


def test_every_family_has_a_block():
    """The family records (ulysses_jax/families.py) and the blocks (models/blocks.py) name the
    same families, and each record's parts resolve: a block class, a (prefill, decode) pair,
    a Hugging Face record whose model types no other family's has."""
    from ulysses_jax.families import FAMILIES, load
    from ulysses_jax.interop.hf_family import HFFamily
    from ulysses_jax.models.blocks import BLOCKS
    assert set(FAMILIES) == set(BLOCKS) and "llama" in BLOCKS
    model_types, generated = [], []
    for name, fam in FAMILIES.items():
        assert isinstance(BLOCKS[name], type) and BLOCKS[name] is load(fam.block), name
        if fam.generation is not None:
            prefill, decode = load(fam.generation)
            assert callable(prefill) and callable(decode), name
            generated.append(name)
        hf = load(fam.hf)
        assert isinstance(hf, HFFamily) and hf.archs and hf.layer, name
        model_types += list(hf.archs)
    assert "llama" in generated
    assert len(model_types) == len(set(model_types)) and "llama" in model_types


# The layer of each part a family record names (families.Family): the layer of the module
# that loads it (models/blocks.py, generation/blocks.py, interop/hf.py).
PARTS = {"block": "models", "generation": "generation", "hf": "interop"}


def test_family_parts_live_in_their_layers():
    """A record's parts are imported by name (``families.load``), edges the walk above does
    not see: each names a package module in the layer of the code that loads it."""
    from ulysses_jax.families import FAMILIES
    mods = _modules()
    checked = 0
    for name, fam in FAMILIES.items():
        for part, layer in PARTS.items():
            ref = getattr(fam, part)
            if ref is None:
                continue
            module = "ulysses_jax." + ref.partition(":")[0]
            assert module in mods, f"{name}.{part} = {ref!r}: no such module"
            assert LAYERS[_layer(module)][0] == layer, (
                f"{name}.{part} = {ref!r} is in layer {LAYERS[_layer(module)][0]}, not {layer}")
            checked += 1
    assert checked >= 2 * len(FAMILIES)
