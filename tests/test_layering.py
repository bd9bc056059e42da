"""The layers stay apart: the engine never imports Qt; the GUI never imports torch & co."""

import ast
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
        ("engine", "PySide6"),
        ("engine.cli", "PySide6"),
    ],
)
def test_importing_a_package_does_not_load_the_other_side(package, forbidden):
    code = f"import sys, {package}; print({forbidden!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
