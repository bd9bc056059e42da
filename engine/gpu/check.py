"""The ahead-of-time kernels proven on a GPU: `run(limit)` for `python -m engine.bench.gpu`.

Contract: `run(limit)` loads each fused MoE kernel's cubin through the CUDA driver
(engine.gpu.launcher), runs one token's experts at a Qwen3-30B-A3B layer's shape (H 2048, I 768,
top-8 of experts in shuffled slots of a pool), compares the outputs with the torch reference
(`engine.formats.gguf.blocks.dequantize` → `F.linear` in float32 → silu(gate) · up → Σ_k w_k ·
down_k), and times the kernels with CUDA events: the quantized bytes they read a second against
the card's own device-to-device copy rate. A result per type pair; an error is that pair's result.
`random_blocks` makes the valid random blocks both this check and the interpreter tests use.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.formats.gguf.blocks import TYPES, dequantize, row_bytes

HIDDEN, INTER, EXPERTS, SLOTS, TOP_K = 2048, 768, 16, 24, 8
ALIGN = 64  # fields start on 64-byte boundaries, as ExpertLayout places them
BLOCK_N = 8  # rows a program, as the registry builds the kernels
# (gate_up, down) as files pair them: Q4_K_M and Q5_K_M give down Q6_K in some layers
TYPE_PAIRS = (
    (QT.Q4_K, QT.Q4_K),
    (QT.Q4_K, QT.Q6_K),
    (QT.Q6_K, QT.Q6_K),
    (QT.Q8_0, QT.Q8_0),
    (QT.Q5_K, QT.Q6_K),
    (QT.IQ4_XS, QT.IQ4_XS),
    (QT.IQ4_NL, QT.IQ4_NL),
    (QT.MXFP4, QT.MXFP4),
)


def random_blocks(ggml_type: QT, rows: int, columns: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 `[rows, row bytes]`: random codes and scales, float16 fields and MXFP4's e8m0 exponents
    finite and of moderate size (so that every block counts in the sums), a few of them subnormal."""
    traits = TYPES[ggml_type]
    data = rng.integers(0, 256, (rows, row_bytes(ggml_type, columns)), dtype=np.uint8)
    blocks = data.reshape(-1, traits.block_bytes)
    start = 0
    for field in traits.fields:
        if field.kind == "f16":
            values = rng.standard_normal((len(blocks), 1)) * np.exp2(rng.integers(-12, -5, (len(blocks), 1)))
            values[::97] = 3e-6  # a float16 subnormal
            blocks[:, start : start + 2] = values.astype(np.float16).view(np.uint8)
        elif ggml_type == QT.MXFP4 and field.name == "e":  # scales 2^(e − 128), as the f16 ones
            exponents = rng.integers(116, 124, len(blocks))
            exponents[::97], exponents[1::97] = 0, 1  # float32 subnormal scales
            blocks[:, start] = exponents
        start += field.nbytes
    return torch.from_numpy(data)


def run(limit: float) -> dict:
    if not torch.cuda.is_available():
        return {"error": "no CUDA device"}
    deadline, results = time.monotonic() + limit, {"copy_gbps": _copy_gbps()}
    for pair in TYPE_PAIRS:
        name = f"{pair[0].name}/{pair[1].name}"
        if time.monotonic() > deadline:
            results[name] = {"skipped": "out of time"}
            continue
        try:
            results[name] = _check_pair(pair, np.random.default_rng(0))
        except Exception as err:  # one pair's failure is its result; the others still run
            results[name] = {"error": f"{type(err).__name__}: {err}"}
    return results


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _check_pair(pair: tuple[QT, QT], rng: np.random.Generator) -> dict:
    from engine.gpu.launcher import CubinKernel

    gate_up_type, down_type = pair
    gate_up = [random_blocks(gate_up_type, 2 * INTER, HIDDEN, rng) for _ in range(EXPERTS)]
    down = [random_blocks(down_type, HIDDEN, INTER, rng) for _ in range(EXPERTS)]
    down_offset = _aligned(gate_up[0].numel())
    nbytes = _aligned(down_offset + down[0].numel())
    pool = torch.from_numpy(rng.integers(0, 256, (SLOTS, nbytes), dtype=np.uint8))
    slots = rng.permutation(SLOTS)[:EXPERTS]
    for expert, slot in enumerate(slots):
        pool[slot, : gate_up[expert].numel()] = gate_up[expert].reshape(-1)
        pool[slot, down_offset : down_offset + down[expert].numel()] = down[expert].reshape(-1)
    cuda = torch.device("cuda")
    pool, table = pool.to(cuda), torch.tensor(slots, device=cuda)
    ids = torch.tensor(rng.choice(EXPERTS, TOP_K, replace=False), device=cuda)
    x = torch.randn(HIDDEN, device=cuda)
    weights = torch.rand(TOP_K, device=cuda)
    first = CubinKernel.load(f"moe_gate_up_{gate_up_type.name.lower()}_fp32")
    second = CubinKernel.load(f"moe_down_{down_type.name.lower()}_fp32")
    act = torch.empty(TOP_K, INTER, device=cuda)
    out = torch.empty(HIDDEN, device=cuda)

    def step() -> None:
        first(((INTER + BLOCK_N - 1) // BLOCK_N, TOP_K), x, pool, table, ids, act, nbytes, 0, INTER, HIDDEN)
        grid = ((HIDDEN + BLOCK_N - 1) // BLOCK_N,)
        second(grid, act, pool, table, ids, weights, out, nbytes, down_offset, HIDDEN, INTER, TOP_K)

    step()
    wanted_act, wanted = _reference(gate_up, down, pair, x, ids.tolist(), weights)
    seconds = _timed(step)
    read = TOP_K * (gate_up[0].numel() + down[0].numel())  # the quantized bytes a step reads
    return {
        "act_rel_error": _relative(act, wanted_act),
        "out_rel_error": _relative(out, wanted),
        "step_us": round(seconds * 1e6, 1),
        "gbps": round(read / seconds / 1e9, 1),
    }


def _reference(gate_up, down, pair, x, ids, weights) -> tuple[torch.Tensor, torch.Tensor]:
    acts, out = [], torch.zeros(HIDDEN, device=x.device)
    for k, expert in enumerate(ids):
        w = dequantize(gate_up[expert].to(x.device), pair[0], (2 * INTER, HIDDEN), torch.float32)
        gate, up = F.linear(x, w).chunk(2)
        acts.append(F.silu(gate) * up)
        w = dequantize(down[expert].to(x.device), pair[1], (HIDDEN, INTER), torch.float32)
        out += weights[k] * F.linear(acts[-1], w)
    return torch.stack(acts), out


def _relative(got: torch.Tensor, wanted: torch.Tensor) -> float:
    """max|Δ| over max|wanted|: the tests' bound is 1e-6."""
    return float((got - wanted).abs().max() / wanted.abs().max().clamp_min(1e-30))


def _timed(step, repeats: int = 200) -> float:
    """Seconds a call of `step`, from CUDA events around `repeats` calls after a warm-up."""
    for _ in range(10):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _copy_gbps() -> float:
    """The card's device-to-device copy rate (bytes read and written), the kernels' yardstick."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = _timed(lambda: target.copy_(source), repeats=10)
    return round(2 * source.numel() / seconds / 1e9, 1)
