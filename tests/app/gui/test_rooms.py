"""`app.gui`'s rooms keep to what their docstrings say: each room imports only its own modules and
the rooms below it, the screens never import each other, and each room's docstring names its modules."""

import ast
import importlib
from pathlib import Path

GUI = Path(__file__).resolve().parents[3] / "app" / "gui"
# bottom up; rooms on one level never import each other
LEVELS: tuple[tuple[str, ...], ...] = (
    ("widgets", "engine"),
    ("chat", "dashboard", "models", "server", "settings", "tune"),
    ("window",),
    ("startup",),
)
LEVEL = {room: rank for rank, rooms in enumerate(LEVELS) for room in rooms}


def gui_rooms_imported(path: Path) -> set[str]:
    """The rooms of `app.gui` that `path` imports, at any depth (function-level imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return {name.split(".")[2] for name in names if name.startswith("app.gui.")}


def test_every_module_lives_in_a_room_of_the_layering():
    assert {path.parent.name for path in GUI.glob("*/*.py")} == set(LEVEL)
    assert [path.name for path in GUI.glob("*.py")] == ["__init__.py"]


def test_a_room_imports_only_itself_and_the_rooms_below_it():
    wrong = {
        f"{path.relative_to(GUI)} -> {room}"
        for path in GUI.glob("*/*.py")
        for room in gui_rooms_imported(path)
        if room != path.parent.name and LEVEL[room] >= LEVEL[path.parent.name]
    }
    assert not wrong, sorted(wrong)


def test_each_room_names_all_its_modules():
    assert all(f"`{room}`" in importlib.import_module("app.gui").__doc__ for room in LEVEL)
    for room in LEVEL:
        doc = importlib.import_module(f"app.gui.{room}").__doc__
        modules = [path.stem for path in (GUI / room).glob("*.py") if path.stem != "__init__"]
        unnamed = [module for module in modules if f"`{module}`" not in doc]
        assert not unnamed, f"app.gui.{room}'s docstring does not name {unnamed}"
