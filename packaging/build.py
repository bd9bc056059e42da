"""Build the one-folder bundle and check it: `python packaging/build.py`.

    pip install -e ".[bundle]"            # PyInstaller (and Pillow for make_icons.py)
    python packaging/build.py             # -> dist/moe-chat/, then runs its --self-test

The bundle carries the torch that is installed: install the CPU build
(`pip install torch==2.13.0` on these machines) for a small, GPU-less bundle, or a CUDA
build for one that runs on NVIDIA GPUs (several GB larger). Prints the build time and
the folder's size; `--json FILE` writes them with the self-test's result. Exit status 0
when the build and the self-test pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "packaging" / "moe-chat.spec"
SELF_TEST_TIMEOUT_S = 300


def executable(dist: Path) -> Path:
    """The bundle's `moe-chat` executable (inside the .app on macOS)."""
    if sys.platform == "darwin":
        return dist / "MoE Chat.app" / "Contents" / "MacOS" / "moe-chat"
    return dist / "moe-chat" / ("moe-chat.exe" if sys.platform == "win32" else "moe-chat")


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def build(dist: Path, work: Path) -> float:
    """Run PyInstaller on the spec; the seconds it took. Raises CalledProcessError when it fails."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN"]
    subprocess.run([*command, "--distpath", str(dist), "--workpath", str(work), str(SPEC)], check=True)
    return time.perf_counter() - started


def self_test(exe: Path, *extra: str) -> tuple[int, str]:
    """Run `moe-chat --self-test` (offscreen); its exit status and last line of output."""
    env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    try:
        done = subprocess.run(
            [str(exe), "--self-test", *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=SELF_TEST_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return 1, f"self-test FAILED: no result within {SELF_TEST_TIMEOUT_S} s"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else f"(no output; stderr: {done.stderr.strip()[-500:]})"


def xcb_packages_not_carried(bundle: Path) -> list[str]:
    """Linux: the apt packages of Qt's X11 libraries the bundle lacks (PyInstaller copies those the
    build machine has); the machines it runs on need these installed, and the app says so at start."""
    if not sys.platform.startswith("linux"):
        return []
    sys.path.insert(0, str(ROOT))
    from app.gui.startup.system_libs import XCB_LIBRARIES

    carried = {path.name for path in bundle.rglob("*.so*")}
    return [package for soname, package in XCB_LIBRARIES.items() if soname not in carried]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where the bundle goes")
    parser.add_argument("--work", type=Path, default=ROOT / "build", help="PyInstaller's scratch folder")
    parser.add_argument("--no-self-test", action="store_true", help="build only")
    parser.add_argument("--json", type=Path, help="write build time, size and self-test result here")
    args = parser.parse_args(argv)
    try:
        import PyInstaller  # noqa: F401
        import torch
    except ImportError as err:
        print(f'error: {err.name} is not installed; run: pip install -e ".[bundle]"', file=sys.stderr)
        return 2
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else " (CPU only)"
    torch_build = f"torch {torch.__version__}{cuda}"
    print(f"Building the MoE Chat bundle with {torch_build} into {args.dist} …", flush=True)
    try:
        seconds = build(args.dist, args.work)
    except subprocess.CalledProcessError as err:
        print(f"error: PyInstaller failed with status {err.returncode}", file=sys.stderr)
        return 1
    exe = executable(args.dist)
    bundle = exe.parents[2] if sys.platform == "darwin" else exe.parent
    size = folder_bytes(bundle)
    print(f"Built {bundle} in {seconds / 60:.1f} min: {size / 2**20:.0f} MiB ({torch_build}).")
    result = {"seconds": seconds, "bytes": size, "torch": torch_build, "executable": str(exe)}
    not_carried = xcb_packages_not_carried(bundle)
    if not_carried:
        print(f"Not in the bundle (its users need them): sudo apt install {' '.join(not_carried)}")
    result["xcb_packages_not_carried"] = not_carried
    status = 0
    if not args.no_self_test:
        status, line = self_test(exe)
        print(line)
        result["self_test"] = {"status": status, "line": line}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
