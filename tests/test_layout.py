"""The package's architecture as a test: its folders have an order (docs/layout.md), no module imports a higher
folder's, and no two modules import each other, lazy and typing-only imports included: a lazy import ties two rooms
together just as a top-level one does."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "yoloaccum"
LAYOUT = PACKAGE.parent / "docs" / "layout.md"

# Bottom first. A module may import from its own folder and from the folders before it. The top-level modules are
# rooms of their own: errors at the bottom (every folder raises it), the API, the package's front and the CLI on top.
ORDER = [
    "errors",
    "config",
    "process",
    "distributed",
    "core",
    "data",
    "model",
    "batchnorm",
    "evaluation",
    "training",
    "commands",
    "api",
    "__init__",
    "cli",
    "__main__",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """The package's modules that `path` imports anywhere in it: at the top, inside functions, under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("yoloaccum"):
            for alias in node.names:  # `from yoloaccum.core import engine` imports the module engine
                child = f"{node.module}.{alias.name}"
                found.add(child if child in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("yoloaccum")}
    return {m for m in found if m in MODULES} - {module_name(path)}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def room(module: str) -> str:
    """A module's folder, or a top-level module's own name ("__init__" for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each a list of names."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_sits_in_a_room_of_the_order():
    assert {room(m) for m in MODULES} <= set(ORDER), "a new folder or top-level module: add it to ORDER and layout.md"


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_no_import_runs_against_the_order():
    rank = {name: i for i, name in enumerate(ORDER)}
    against = sorted(f"{a} imports {b}" for a, deps in GRAPH.items() for b in deps if rank[room(b)] > rank[room(a)])
    assert against == []


def test_each_folder_says_its_job_and_is_on_the_map():
    layout = LAYOUT.read_text()
    for folder in sorted(p.parent for p in PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and len(doc) > 80, f"{folder.name}/__init__.py opens with a paragraph on the folder's job"
        assert f"`{folder.name}/`" in layout, f"docs/layout.md misses {folder.name}/"
        for module in folder.glob("*.py"):
            if module.name != "__init__.py":
                assert f"`{module.name}`" in layout, f"docs/layout.md misses {folder.name}/{module.name}"


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected
