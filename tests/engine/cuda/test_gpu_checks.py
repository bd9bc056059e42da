"""Every registered cubin on a GPU through the checks of `python -m engine.bench.gpu`'s kernels stage
(engine.gpu.checks), at the small shapes the interpreter runs them at (tests/engine/gpu/test_checks.py):
the decoder's norms, rotary + KV write, router and attention, each stored type's routed experts and
GEMVs, the smoke kernel, each against torch within the stage's tolerances.

Every test needs a CUDA device (conftest skips them without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.gpu.checks import stage
from engine.gpu.checks.case import run_case
from tests.engine.gpu.test_checks import SMALL

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("spec", stage.CASES, ids=[spec.label for spec in stage.CASES])
def test_each_cubin_meets_its_check(spec):
    from engine.gpu.launcher import CubinKernel

    case = spec.build(SMALL, "cuda", np.random.default_rng(0))
    entries = run_case(case, CubinKernel.load, torch.cuda.synchronize)
    assert all(entry.get("ok") for entry in entries.values()), entries
