"""The rooms and rules in DESIGN.md, checked: the engine never imports Qt; the GUI never imports
torch & co.; within the engine a room imports only rooms below it; nothing imports in a circle."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "engine": {"PySide6", "PyQt5", "PyQt6", "shiboken6", "pyqtgraph", "qtpy"},
    "app": {"torch", "transformers", "safetensors", "accelerate", "bitsandbytes"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports_anywhere_in_the_source(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_modules(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}, f"{package}/ imports what it must not"


def test_the_checker_sees_nested_and_aliased_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import torch.cuda as c\n    from PySide6.QtCore import QObject\n")
    assert {"torch", "PySide6"} <= imported_modules(source)


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("app", "torch"),
        ("app.terminal.chat", "torch"),
        ("app.server.openai_server", "torch"),
        ("app.gui.window.main_window", "fastapi"),  # the server's stack stays out of the window's start
        ("app.main", "uvicorn"),
        ("engine", "PySide6"),
        ("engine.cli", "PySide6"),
    ],
)
def test_importing_a_package_does_not_load_the_other_side(package, forbidden):
    code = f"import sys, {package}; print({forbidden!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


# The engine's rooms, bottom up (engine/__init__.py says what each holds). A module may import
# modules of its own room or of a lower one, never of a higher one.
ENGINE_ROOMS: tuple[tuple[str, ...], ...] = (
    ("engine.errors", "engine.config", "engine.generation_config", "engine.resources", "engine.huge_pages"),
    ("engine.sampling", "engine.text"),
    ("engine.model",),
    ("engine.tiny",),
    ("engine.ggml",),
    ("engine.formats",),
    ("engine.gpu",),
    ("engine.store",),
    ("engine.device_cache",),
    ("engine.moe",),
    ("engine.resident",),
    ("engine.decode",),
    ("engine.offloaded_model",),
    ("engine.metrics",),
    ("engine.speculative",),
    (
        "engine.constraints",
        "engine.generation",
        "engine.loader",
        "engine.prompts",
        "engine.options",
    ),
    ("engine.tune",),
    ("engine.worker",),
    ("engine.remote",),
    ("engine.bench", "engine.cli", "engine.__main__"),
)
APP_ROOMS: tuple[tuple[str, ...], ...] = (
    (
        "app.settings",
        "app.storage",
        "app.catalog",
        "app.catalog_checks",
        "app.model_library",
        "app.download_child",
        "app.session_setup",
        "app.remote_setup",
        "app.desktop_entry",
        "app.markdown_render",
    ),
    ("app.server",),
    ("app.terminal",),
    ("app.gui",),
    ("app.main", "app.__main__"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    """Every engine/app module `path` imports, at any depth (function-level imports too),
    resolved to the module (not the name imported from it). TYPE_CHECKING blocks count too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {name for name in found if name.split(".")[0] in {"engine", "app"} and _is_module(name)}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def room_of(module: str, rooms: tuple[tuple[str, ...], ...]) -> int | None:
    for rank, members in enumerate(rooms):
        if any(module == m or module.startswith(m + ".") for m in members):
            return rank
    return None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for package in ("engine", "app"):
        for path in (ROOT / package).rglob("*.py"):
            graph[module_name(path)] = project_imports(path) - {module_name(path)}
    return graph


@pytest.mark.parametrize(("package", "rooms"), [("engine", ENGINE_ROOMS), ("app", APP_ROOMS)])
def test_every_module_has_a_room_and_imports_none_above_it(package, rooms):
    graph = import_graph()
    modules = [m for m in graph if m.split(".")[0] == package and m != package]
    homeless = [m for m in modules if room_of(m, rooms) is None]
    assert not homeless, f"modules in no room of {package}'s layering: {homeless}"
    upward = {
        f"{m} -> {dep}"
        for m in modules
        for dep in graph[m]
        if dep.split(".")[0] == package and dep != package and room_of(dep, rooms) > room_of(m, rooms)
    }
    assert not upward, f"a lower room imports a higher one: {sorted(upward)}"


def test_the_rooms_name_what_each_layer_must_never_import():
    """DESIGN.md's rules, spelled out: the checkpoint readers never reach the experts' rooms, the
    experts' rooms never reach decoding, and none of them speculation, tuning, the worker or the bench."""
    graph = import_graph()
    above_experts = ("engine.speculative", "engine.worker", "engine.bench", "engine.tune")
    experts = ("engine.formats", "engine.store", "engine.device_cache", "engine.moe")
    never = {
        "engine.model": (*experts, "engine.ggml", "engine.decode", *above_experts),
        "engine.ggml": (*experts, "engine.decode", *above_experts),
        # the fused kernels read bytes: below them only the base modules and `formats` (the rooms
        # above are out by the order)
        "engine.gpu": (
            "engine.sampling",
            "engine.text",
            "engine.model",
            "engine.tiny",
            "engine.ggml",
        ),
        **{room: ("engine.decode", "engine.offloaded_model", *above_experts) for room in experts},
        "engine.decode": above_experts,
        "engine.speculative": ("engine.generation", "engine.worker", "engine.bench", "engine.tune"),
        "engine.tune": ("engine.worker", "engine.bench", "engine.cli"),
    }
    for module, deps in graph.items():
        for room, forbidden in never.items():
            if room_of(module, ((room,),)) is not None:
                bad = {d for d in deps if room_of(d, (forbidden,)) is not None}
                assert not bad, f"{module} imports {sorted(bad)}"


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the import cycles (components with more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_nothing_imports_in_a_circle():
    # a package's __init__ importing its own modules is not a circle of responsibilities
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in import_graph().items()}
    assert strongly_connected(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_subpackage_opens_with_its_contract():
    for package in ("engine", "app"):
        for init in (ROOT / package).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and len(doc.splitlines()) >= 2, f"{init.relative_to(ROOT)} says nothing of its room"


def test_modules_and_functions_stay_small():
    """No module past ~400 lines, no function past ~60: past that, split it (DESIGN.md)."""
    too_long = []
    for package in ("engine", "app"):
        for path in (ROOT / package).rglob("*.py"):
            source = path.read_text()
            if len(source.splitlines()) > 400:
                too_long.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > 60:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.name}: {length} lines")
    assert not too_long, too_long


def test_no_room_holds_more_than_sixteen_modules():
    """A folder past ~16 modules does several jobs: it is asking to be split into rooms."""
    crowded = {}
    for package in ("engine", "app"):
        for init in (ROOT / package).rglob("__init__.py"):
            modules = [p for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            if len(modules) > 16:
                crowded[str(init.parent.relative_to(ROOT))] = len(modules)
    assert not crowded, crowded


def test_every_package_names_its_modules():
    """A room's contract names every module and sub-package in it (a newcomer reads it first)."""
    unnamed = {}
    for package in ("engine", "app"):
        for init in (ROOT / package).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            parts = [p.stem for p in init.parent.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            parts += [p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
            missing = [name for name in parts if not re.search(rf"\b{name}\b", doc)]
            if missing:
                unnamed[str(init.parent.relative_to(ROOT))] = missing
    assert not unnamed, unnamed
