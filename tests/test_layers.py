"""The package's layers read top to bottom: a module imports only from its own layer or below
(function-level imports included), and no two modules import each other, directly or around a
circle. `docs/architecture.md` names the same layers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tandem"
# Bottom first. Modules of one layer may import each other (without a cycle).
LAYERS = [
    (
        "plain state",
        ("tandem.config", "tandem.request", "tandem.metrics", "tandem.reasoning", "tandem.lora"),
    ),
    ("kernels", ("tandem.ops",)),
    ("scheduling", ("tandem.scheduling",)),
    ("models and sampler", ("tandem.models", "tandem.sampler")),
    ("execution", ("tandem.execution",)),
    ("engine", ("tandem.engine",)),
    (
        "surfaces",
        (
            "tandem.llm",
            "tandem.cli",
            "tandem.chat",
            "tandem.bench",
            "tandem.server",
            "tandem.__main__",
        ),
    ),
]
FACE = "tandem"  # tandem/__init__.py re-exports the public API from the layers


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    for level, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS (and the docs)")


def imports(path: Path) -> set[str]:
    """The tandem modules `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            if base == "tandem" or base.startswith("tandem."):
                # `from tandem.x import y` may name a module y; otherwise it names a symbol of x.
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                    is_package = (PACKAGE.parent / Path(*sub.split("."))).is_dir()
                    found.add(sub if is_module or is_package else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tandem"))
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def test_every_import_points_down_or_sideways():
    upward = []
    for module, targets in graph().items():
        if module == FACE:
            continue
        for target in targets:
            if target != FACE and layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")  # fmt: skip
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done or module not in edges:
            return
        for target in sorted(edges[module]):
            # A package's __init__ importing its own modules is its face, not a cycle.
            if target != FACE and not target.startswith(module + "."):
                visit(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])


# The server's own layers, bottom first: the engine-core process and the link to it; what every
# API's requests pass through in a front end; the translation every API shares; the APIs, side
# by side; and the app and processes that put them together.
SERVER_LAYERS = [
    ("core", ("tandem.server.core",)),
    ("front end", ("tandem.server.frontend",)),
    ("translation", ("tandem.server.generation",)),
    ("APIs", ("tandem.server.openai", "tandem.server.responses", "tandem.server.anthropic",
              "tandem.server.ollama", "tandem.server.web")),
    ("assembly", ("tandem.server.app", "tandem.server.frontend_process", "tandem.server.serve")),
]  # fmt: skip
APIS = SERVER_LAYERS[3][1]


def server_layer_of(module: str) -> int:
    for level, (_, prefixes) in enumerate(SERVER_LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module} belongs to no server layer: add it to SERVER_LAYERS")


def test_the_server_reads_top_to_bottom_and_its_apis_stand_apart():
    """No server module imports one above it, and no API imports another: adding an API adds a
    package (and a line in the app), touching no other API's file."""
    wrong = []
    for module, targets in graph().items():
        if not module.startswith("tandem.server.") or module == "tandem.server":
            continue
        level = server_layer_of(module)
        for target in targets:
            if not target.startswith("tandem.server."):
                continue
            if server_layer_of(target) > level:
                wrong.append(f"{module} imports {target}, a layer above it")
            api = next((a for a in APIS if module.startswith(a + ".")), None)
            other = next((a for a in APIS if target.startswith(a + ".")), None)
            if api and other and api != other:
                wrong.append(f"{module} (an API) imports {target}, another API")
    assert not wrong, "\n".join(wrong)
