"""Triton's interpreter for a test module, in a child process.

`triton.jit` (Triton's own library included) picks the interpreter when it decorates, from the
environment at that moment, for the whole process: set in the test session, it would turn every
later triton kernel into an interpreted one (the ahead-of-time build compiles these very kernels).
So a module whose tests interpret kernels on the CPU runs itself again in a child started with
TRITON_INTERPRET=1, its tests marked `in_the_interpreter`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the child interpreter")
ROOT = Path(__file__).resolve().parents[3]


def run_in_child_interpreter(test_file: str, timeout: int = 240) -> None:
    """pytest on `test_file` in a process with TRITON_INTERPRET=1 from its start; fails with the
    child's output unless every test passed."""
    if INTERPRETED:
        pytest.skip("in the interpreter already")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
