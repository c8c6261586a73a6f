"""The package's shape, checked from source with `ast` (nothing is imported):

- the module-level imports between specdec's modules form no cycle, and neither do those between
  its packages (each subpackage one node, each top-level module its own); imports under
  `if TYPE_CHECKING:` count as module-level, since a circle of types is a circle of design;
- `importlib.import_module` loads specdec's own modules only where a registry or a router
  collects its members (ALLOWED_DYNAMIC_IMPORTS), so no import loop hides behind it;
- specdec's own modules are imported at module level, not inside functions, except where
  the import defers an optional heavy dependency (ALLOWED_LATE_IMPORTS, each with a reason);
  registries load their members with `importlib.import_module`, which is not an import statement;
- no module is longer than MAX_MODULE_LINES;
- no function is longer than MAX_FUNCTION_LINES unless a `# long: <reason>` comment sits on the
  line above its `def` (or its decorators), or its docstring's first line starts with "long:".
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "specdec"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

# (importing module, imported specdec module) -> why the import waits for the call.
ALLOWED_LATE_IMPORTS: dict[tuple[str, str], str] = {
    **{(name, "specdec.backends.hf"): (
        "backends.hf loads transformers' model code (a second), and every command's parser loads this"
    ) for name in ("specdec.bench.peers", "specdec.train.cli", "specdec.train.layerskip_search")},
    ("specdec.serve.cli", "specdec.serve.app"): (
        "serve.app needs fastapi (the serve extra), and every command's parser loads serve.cli"
    ),
    ("specdec.serve.cli", "specdec.serve.ray_serve"): (
        "ray_serve needs ray (the ray extra), loaded only for --replicas > 1 or --ray-address"
    ),
    ("specdec.backends.native.kernels.int4_blocks", "specdec.backends.native.kernels.jit.int4_unpack"): (
        "jit.int4_unpack needs numba (the cpu extra) and compiles its kernel on first use"
    ),
    ("specdec.backends.native.kernels.int8_blocks", "specdec.backends.native.kernels.jit.supertiles"): (
        "jit.supertiles needs numba (the cpu extra) and compiles its kernels on first use"
    ),
    ("specdec.backends.native.kernels.int8_blocks", "specdec.backends.native.kernels.jit.tiles16"): (
        "jit.tiles16 needs numba (the cpu extra) and compiles its kernel on first use"
    ),
    ("specdec.backends.native.kernels.int8_blocks", "specdec.backends.native.kernels.jit.activations"): (
        "jit.activations needs numba (the cpu extra) and compiles its kernels on first use"
    ),
    ("specdec.backends.native.model.one_call", "specdec.backends.native.kernels.jit.layer"): (
        "jit.layer needs numba (the cpu extra) and compiles its kernels on first use"
    ),
    ("specdec.backends.native.kernels.numba_ops", "specdec.backends.native.kernels.jit.attention"): (
        "jit.attention needs numba (the cpu extra) and compiles its kernels, "
        "loaded on a cache's first kernel call"
    ),
    ("specdec.backends.native.kernels.numba_ops", "specdec.backends.native.kernels.jit.norms"): (
        "jit.norms needs numba (the cpu extra) and compiles its kernels on a layer's first call"
    ),
}

# module -> why it loads specdec modules by name. A registry's members register themselves when
# imported and import the registry back, which is what registries are for; nothing else may.
ALLOWED_DYNAMIC_IMPORTS: dict[str, str] = {
    "specdec.registry": "a registry imports its package's member modules so that they register",
    "specdec.serve.routes": "the route package collects the router of each of its route modules",
}


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


@cache
def parse(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(encoding="utf-8"), filename=str(modules()[name]))


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if modules()[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The specdec modules an import statement loads (`from pkg import sub` loads pkg.sub)."""
    known = modules()
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:
        source = _absolute(module, node)
        names = {source} | {f"{source}.{alias.name}" for alias in node.names}
    return {n for n in names if n in known}


def _walk(node: ast.AST, in_function: bool):
    """Yield (import node, inside a function?) for every import, those under `if TYPE_CHECKING:`
    included (they are module-level edges of the design, whether or not they run)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        else:
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            yield from _walk(child, inner)


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name in modules():
        graph[name] = set()
        for node, in_function in _walk(parse(name), False):
            if not in_function:
                graph[name] |= imported(name, node) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def package_of(module: str) -> str:
    """specdec.serve.app -> specdec.serve; top-level modules (specdec.engine) are their own node."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (SRC / PACKAGE / parts[1]).is_dir()):
        return ".".join(parts[:2])
    return module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        node = out.setdefault(package_of(name), set())
        node |= {package_of(t) for t in targets} - {package_of(name)}
    for targets in list(out.values()):
        for t in targets:
            out.setdefault(t, set())
    return out


def test_no_package_cycle():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package-level import cycle: " + " -> ".join(cycle)


def test_package_graph_catches_a_planted_cycle():
    # train -> drafters -> train, through modules that are not each other's
    graph = {"specdec.train.cli": {"specdec.drafters.retrieval"},
             "specdec.drafters.retrieval": {"specdec.errors"},
             "specdec.drafters.common": {"specdec.train.data"}, "specdec.train.data": set(),
             "specdec.errors": set()}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) == ["specdec.drafters", "specdec.train", "specdec.drafters"]


def dynamic_imports(tree: ast.Module) -> list[int]:
    """Lines that call importlib.import_module (or a bare import_module)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("importlib.import_module", "import_module", "__import__"):
                lines.append(node.lineno)
    return lines


def test_dynamic_imports_only_where_allowed():
    found, used = [], set()
    for name, path in modules().items():
        for line in dynamic_imports(parse(name)):
            if name in ALLOWED_DYNAMIC_IMPORTS:
                used.add(name)
            else:
                found.append(f"{path.relative_to(SRC)}:{line}")
    assert not found, ("import specdec modules with import statements (or allowlist with a reason):\n"
                       + "\n".join(found))
    assert used == set(ALLOWED_DYNAMIC_IMPORTS), f"stale entries: {set(ALLOWED_DYNAMIC_IMPORTS) - used}"


def test_dynamic_import_check_sees_a_planted_loop():
    tree = ast.parse("import importlib\ndef f():\n    return importlib.import_module('specdec.cli')\n")
    assert dynamic_imports(tree) == [3]


def test_find_cycle_reports_the_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_walk_tells_module_level_from_function_level_imports():
    tree = ast.parse(
        "import a\n"
        "if TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "class K:\n    import d\n    def m(self):\n        import e\n"
        "def f():\n    if x:\n        from g import h\n"
    )
    found = {ast.unparse(node).split()[1]: nested for node, nested in _walk(tree, False)}
    assert found == {"a": False, "b": False, "c": False, "d": False, "e": True, "g": True}


def test_a_planted_type_checking_circle_is_caught(tmp_path, monkeypatch):
    """Two modules that import each other only for their types still form a cycle."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pool.py").write_text("from specdec.sequence import Sequence\n")
    (package / "sequence.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specdec.pool import Pool\n"
    )
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    modules.cache_clear()
    parse.cache_clear()
    try:
        assert find_cycle(import_graph()) in (
            ["specdec.pool", "specdec.sequence", "specdec.pool"],
            ["specdec.sequence", "specdec.pool", "specdec.sequence"],
        )
    finally:
        modules.cache_clear()
        parse.cache_clear()


def test_no_function_level_imports_of_the_package():
    found = []
    used = set()
    for name, path in modules().items():
        for node, in_function in _walk(parse(name), False):
            if not in_function:
                continue
            for target in sorted(imported(name, node)):
                if (name, target) in ALLOWED_LATE_IMPORTS:
                    used.add((name, target))
                else:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} imports {target}")
    assert not found, "import these at module level (or allowlist with a reason):\n" + "\n".join(found)
    assert not set(ALLOWED_LATE_IMPORTS) - used, (
        f"stale allowlist entries: {set(ALLOWED_LATE_IMPORTS) - used}")


def test_allowlist_gives_reasons():
    for key, reason in ALLOWED_LATE_IMPORTS.items():
        assert len(reason.split()) >= 3, f"{key}: say why the import waits"


def test_modules_are_short():
    long = []
    for path in modules().values():
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(SRC)}: {n} lines")
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def _long_reason(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    above = lines[first - 2].strip() if first >= 2 else ""
    doc = (ast.get_docstring(node) or "").lstrip()
    return above.startswith("# long:") or doc.startswith("long:")


def test_functions_are_short():
    long = []
    for name, path in modules().items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(parse(name)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES and not _long_reason(lines, node):
                long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {n} lines")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them, or say why above the def with "
        "'# long: <reason>'):\n" + "\n".join(long)
    )
