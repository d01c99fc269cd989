"""The package's shape, checked from its source with `ast` (no import, no process): every module
imports only modules below it (the intra-package import graph, counting imports inside functions
and under TYPE_CHECKING, has no circle), private names cross modules only from the leaf
_common.py, no file grows past MAX_LINES, and both hook owners provide what HookManager uses
(_hooks.HookOwner). Named test_structure, not test_layout: "layout" is the buckets' layout here."""
import ast
import pathlib

import pytest

PACKAGE = "megatron_fsdp_c"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE
# A ceiling, not a target (issue 49: files are cut by concern, one object or one concern each, as
# long as it needs): a file past it is a smell to look at, not a file to cut to fit.
MAX_LINES = 800
# Files allowed over MAX_LINES, each with the reason it is one room. Empty: keep it so.
LONG_FILES_ALLOWED = {}
ENGINE = f"{PACKAGE}._C"  # the C extension: imports nothing from the package's Python


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
PACKAGES = {_module_name(p) for p in ROOT.rglob("__init__.py")}


def _is_module(name: str) -> bool:
    return name in MODULES or name == ENGINE


def _imports(module: str, tree: ast.AST):
    """(target module, imported name or None, line) of every import of the package in `tree`,
    wherever it stands (module level, functions, `if TYPE_CHECKING:`). `from X import n` depends
    on X.n when that is a module (not on X: its __init__ is already running), else on X."""
    here = module if module in PACKAGES else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if _is_module(sub):
                    yield sub, None, node.lineno
                else:
                    yield source, alias.name, node.lineno


TREES = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in MODULES.items()}
IMPORTS = {m: list(_imports(m, t)) for m, t in TREES.items()}
GRAPH = {m: sorted({target for target, _, _ in imports if target != m}) for m, imports in IMPORTS.items()}


def _cycle(graph):
    """One import circle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in graph.get(m, ()):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_every_module_parses_and_the_engine_is_known():
    assert f"{PACKAGE}._common" in MODULES and f"{PACKAGE}._hooks" in MODULES
    for m, imports in IMPORTS.items():
        for target, _, line in imports:
            assert _is_module(target), f"{MODULES[m]}:{line} imports {target}, which is no module of the package"


def test_no_import_circle():
    circle = _cycle(GRAPH)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_checker_sees_circles():
    """The graph walk finds a circle through a function-level import (so a pass means something)."""
    tree = ast.parse("def f():\n    from ._hooks import HookManager\n")
    graph = dict(GRAPH)
    graph[f"{PACKAGE}._common"] = sorted({t for t, _, _ in _imports(f"{PACKAGE}._common", tree)})
    graph[f"{PACKAGE}._hooks"] = sorted(set(GRAPH[f"{PACKAGE}._hooks"]) | {f"{PACKAGE}._common"})
    assert _cycle(graph) is not None


def test_leaves():
    """_torch_compat.py is the floor (torch's versions: [Note: supported torch versions]) and
    _common.py the leaf every module may use, on it; _hooks.py knows its owner only as HookOwner."""
    assert GRAPH[f"{PACKAGE}._torch_compat"] == []
    assert GRAPH[f"{PACKAGE}._common"] == [f"{PACKAGE}._torch_compat"]
    for owner_module in ("megatron_fsdp", "_owner", "per_module._root"):
        assert f"{PACKAGE}.{owner_module}" not in GRAPH[f"{PACKAGE}._hooks"]


def test_private_names_cross_modules_only_from_common():
    bad = []
    for m, imports in IMPORTS.items():
        for target, name, line in imports:
            if name and name.startswith("_") and target != f"{PACKAGE}._common":
                bad.append(f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {name} from {target}")
    assert not bad, "private names imported across modules (move them to _common.py or make them public " \
                    "within the package):\n" + "\n".join(bad)


def test_no_long_files():
    for path in LONG_FILES_ALLOWED:
        assert (ROOT.parent / path).exists(), f"{path} is allowed to be long but no longer exists: drop it"
    long = {str(p.relative_to(ROOT.parent)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    long = {p: n for p, n in long.items() if p not in LONG_FILES_ALLOWED}
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"


def _class(module: str, name: str) -> ast.ClassDef:
    for node in TREES[module].body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"no class {name} in {module}")


def _provided(module: str, name: str) -> set:
    """Names a class of the package (with its bases from the package) defines or assigns on self."""
    cls = _class(module, name)
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign):
            out |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    imported = {alias: target for target, alias, _ in IMPORTS[module] if alias}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in imported:
            out |= _provided(imported[base.id], base.id)
        elif isinstance(base, ast.Name) and any(isinstance(n, ast.ClassDef) and n.name == base.id
                                                for n in TREES[module].body):
            out |= _provided(module, base.id)
    return out


@pytest.mark.parametrize("module,owner", [("megatron_fsdp", "MegatronFSDP"), ("per_module._root", "RootState")])
def test_hook_owners_provide_what_hooks_use(module, owner):
    protocol = _class(f"{PACKAGE}._hooks", "HookOwner")
    needed = {s.target.id for s in protocol.body if isinstance(s, ast.AnnAssign)}
    needed |= {s.name for s in protocol.body if isinstance(s, ast.FunctionDef)}
    assert {"param_buffer", "_used", "_after_backward"} <= needed
    uses = {n.attr for n in ast.walk(TREES[f"{PACKAGE}._hooks"]) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "owner"}
    uses |= {n.attr for n in ast.walk(TREES[f"{PACKAGE}._hooks"]) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == "owner"}
    assert uses <= needed, f"_hooks.py uses {sorted(uses - needed)} of its owner beyond HookOwner: add them there"
    missing = needed - _provided(f"{PACKAGE}.{module}", owner)
    assert not missing, f"{owner} does not provide {sorted(missing)} of hooks.HookOwner"


def test_experimental_is_the_per_module_api():
    """megatron_fsdp_c.experimental (Megatron-FSDP's import path) re-exports per_module, nothing else."""
    import megatron_fsdp_c.experimental as experimental
    import megatron_fsdp_c.per_module as per_module
    assert experimental.__all__ == per_module.__all__
    for name in per_module.__all__:
        assert getattr(experimental, name) is getattr(per_module, name), name
    assert [m for m in MODULES if m.startswith(f"{PACKAGE}.experimental")] == [f"{PACKAGE}.experimental"]
