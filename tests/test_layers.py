"""The packages form layers: every import, at module level or inside a function, goes down."""

from __future__ import annotations

import ast
from pathlib import Path

from tests._helpers.layers import imported_names

import deltarec

LAYERS = [
    {
        "__init__",
        "errors",
        "ids",
        "_lazy",
        "stats",
        "faults",
        "ports",
        "environ",
        "readahead",
        "threads",
        "credentials",
    },
    {"artifacts"},
    {"stores", "tracking"},
    {"verify", "model", "serving"},
    {"publish"},
    {"dump"},
    {"train", "api"},
    {"promote"},
    {"testing"},
    {"orchestrate"},
    {"demo"},
    {"cli"},
]
"""Lowest first. A package may import its own layer's packages below it in this list only."""

ENTRY_SCRIPTS = {"train/__main__.py"}
"""``python -m`` entry points: they hand over to the CLI, the top layer."""

SRC = Path(deltarec.__file__).parent


def _rank(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"package deltarec.{package} is in no layer of tests/test_layers.py")


def _imports(path: Path) -> set[str]:
    """The deltarec packages a module imports (``deltarec.X...`` -> ``X``)."""
    out = set()
    for name in imported_names(path):
        parts = name.split(".")
        if parts[0] == "deltarec":
            out.add(parts[1] if len(parts) > 1 else "__init__")
    return out


def _edges() -> list[tuple[str, str, str]]:
    """``(module path, its package, a package it imports)`` for every module but the entry
    scripts."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        package = rel.split("/")[0].removesuffix(".py")
        if rel not in ENTRY_SCRIPTS:
            out += [(rel, package, t) for t in sorted(_imports(path) - {package})]
    return out


def test_every_import_goes_to_the_same_or_a_lower_layer():
    upward = [f"{rel} imports deltarec.{t}" for rel, p, t in _edges() if _rank(t) > _rank(p)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_within_a_layer_no_two_packages_import_each_other():
    edges = {(p, t) for _, p, t in _edges()}
    assert not [(a, b) for a, b in edges if (b, a) in edges and a < b]


def test_the_layer_check_finds_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from deltarec.cli import main\n    return main\n")
    assert "cli" in _imports(module) and _rank("cli") > _rank("stores")


STORE_FACE = {"base", "types", "config", "errors", "naming", "rows", "provision", "backends"}
"""The modules of ``deltarec.stores`` that other packages may import: the interface, its types
and configs, naming, row checks, provisioning and ``open_store``. Backends are reached through
``open_store`` and their :class:`~deltarec.stores.Capabilities`, never by module or class."""

STORE_TOP = STORE_FACE | {"__init__", "urlneeds", "whoserves", "runviews"}
"""The modules at the top of ``stores/``: the face and what every backend shares. A backend's
modules live in its folder (:data:`BACKEND_FOLDERS`)."""

BACKEND_FOLDERS = {"sql", "redis", "featurestore", "replica"}
"""One folder per backend (the SQL stores share one)."""

MAX_MODULE_LINES = 600


def _store_modules(path: Path) -> set[str]:
    """The ``deltarec.stores.X`` modules a module imports (``X``; ``""`` for the face)."""
    out = set()
    for name in imported_names(path):
        parts = name.split(".")
        if parts[:2] == ["deltarec", "stores"]:
            out.add(parts[2] if len(parts) > 2 else "")
    return out


def test_outside_stores_only_the_store_face_is_imported():
    beyond = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("stores/"):
            continue
        for module in sorted(_store_modules(path) - STORE_FACE - {""}):
            beyond.append(f"{rel} imports deltarec.stores.{module}")
    assert not beyond, "backend modules imported outside stores/:\n" + "\n".join(beyond)


def test_no_module_outside_stores_dispatches_on_a_backend_class():
    backends = (
        "RelationalStore",
        "SqliteStore",
        "PostgresStore",
        "RedisStore",
        "FeatureStoreStore",
    )
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("stores/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
                and any(b in ast.unparse(node.args[1]) for b in backends)
            ):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, "dispatch on backend classes (use Capabilities):\n" + "\n".join(found)


def _module_graph(*, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the deltarec modules it imports at run time (function-level imports included,
    ``if TYPE_CHECKING:`` blocks only where ``typing``); ``from pkg import mod`` counts as
    importing ``pkg.mod``."""
    mods: dict[str, Path] = {}
    for path in SRC.rglob("*.py"):
        name = "deltarec." + path.relative_to(SRC).with_suffix("").as_posix().replace("/", ".")
        mods[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        out = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                subs = [s for s in subs if s in mods]
                targets = subs if len(subs) == len(node.names) else [node.module, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            out |= {t for t in targets if t in mods and t != name}
        graph[name] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """The import cycles a depth-first walk of ``graph`` meets, each as ``a -> b -> a``."""
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return cycles


def test_no_module_cycle_function_level_imports_included():
    cycles = _cycles(_module_graph())
    assert not cycles, "module import cycles:\n" + "\n".join(cycles)


def test_no_module_cycle_typing_imports_included():
    """``if TYPE_CHECKING:`` imports draw the structure too: a type a lower module needs moves
    down (or becomes a Protocol there) instead of naming the module above."""
    cycles = _cycles(_module_graph(typing=True))
    assert not cycles, "module import cycles (typing imports included):\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_typing_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == ["a -> b -> c -> a"]


def test_the_top_of_stores_is_the_face_and_every_backend_has_its_folder():
    stores = SRC / "stores"
    top = {p.stem for p in stores.glob("*.py")}
    folders = {p.name for p in stores.iterdir() if (p / "__init__.py").is_file()}
    assert top <= STORE_TOP, f"backend modules at the top of stores/: {sorted(top - STORE_TOP)}"
    assert folders == BACKEND_FOLDERS


def test_every_backend_class_is_in_a_backend_folder_of_stores():
    from deltarec.stores.backends import STORE_CLASSES

    for kind, path in STORE_CLASSES.items():
        module, _, cls = path.rpartition(".")
        parts = module.split(".")
        assert parts[:2] == ["deltarec", "stores"] and parts[2] in BACKEND_FOLDERS, (kind, path)
        file = SRC.joinpath(*parts[1:]).with_suffix(".py")
        classes = {
            n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.ClassDef)
        }
        assert cls in classes, f"{path}: no class {cls} in {file}"


def test_no_module_under_src_is_over_600_lines():
    sizes = {
        p.relative_to(SRC).as_posix(): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")
    }
    over = {rel: n for rel, n in sorted(sizes.items()) if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def _module_names() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        name = "deltarec." + path.relative_to(SRC).with_suffix("").as_posix().replace("/", ".")
        mods[name.removesuffix(".__init__")] = path
    return mods


def _private_calls_into_modules(path: Path, mods: dict[str, Path]) -> list[str]:
    """``module._private(...)`` calls of ``path`` whose ``module`` is another deltarec module."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> the deltarec module it names
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods:
                    bound[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if f"{node.module}.{a.name}" in mods:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr = node.func.attr
        target = ast.unparse(node.func.value)
        module = bound.get(target, target if target in mods else None)
        if module and attr.startswith("_") and not attr.startswith("__"):
            out.append(f"{node.lineno}: {module}.{attr}(...)")
    return out


def test_no_module_calls_another_modules_private_function():
    mods = _module_names()
    found = [
        f"{path.relative_to(SRC).as_posix()}:{call}"
        for path in sorted(SRC.rglob("*.py"))
        for call in _private_calls_into_modules(path, mods)
    ]
    assert not found, "private functions called from another module:\n" + "\n".join(found)


def test_the_private_call_check_finds_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from deltarec.publish import publisher\nimport deltarec.stores.naming as n\n"
        "publisher._hidden()\nn._quote('x')\npublisher.public()\n"
    )
    calls = _private_calls_into_modules(module, _module_names())
    assert calls == [
        "3: deltarec.publish.publisher._hidden(...)",
        "4: deltarec.stores.naming._quote(...)",
    ]


def _private_methods_by_folder() -> dict[str, set[str]]:
    """Private method name -> the folders (``publish``, ``stores/sql``) whose classes define it."""
    out: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        folder = path.parent.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    name = getattr(item, "name", "")
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
                        name.startswith("_") and not name.startswith("__")
                    ):
                        out.setdefault(name, set()).add(folder)
    return out


def test_private_methods_are_called_only_from_their_own_folder():
    """``obj._method(...)`` only where a class of the same folder defines ``_method``: no
    module is another package's friend (the publisher's collaborators use its public methods).
    """
    defined = _private_methods_by_folder()
    found = []
    for path in sorted(SRC.rglob("*.py")):
        folder = path.parent.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr, owner = node.func.attr, node.func.value
            if ast.unparse(owner) in ("self", "cls", "super()") or attr not in defined:
                continue
            if folder in defined[attr]:
                continue
            found.append(
                f"{path.relative_to(SRC).as_posix()}:{node.lineno} {ast.unparse(node.func)}"
            )
    assert not found, "private methods called from another folder:\n" + "\n".join(found)
