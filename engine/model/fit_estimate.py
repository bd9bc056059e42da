"""Whether a model fits this computer, and where it would live: one estimate for the catalog and
`python -m engine fit MODEL`.

Contract: `estimate_fit(model, ram_bytes, vram_bytes, context_tokens)` takes a model's bytes
(`ModelBytes`: its routed experts as stored, the rest as the loader holds it, the KV cache for the
context) and says how the engine would place it: routed experts in host RAM, the rest and the KV
cache on the GPU where they fit beside its headroom (else everything in RAM), and what share of the
experts the GPU's remaining memory could cache. A float release whose experts do not fit is
counted as the loader keeps it (engine.loader.host_store_quant: int8, else int4, both lossy), and
the summary says so. Usable RAM is `RAM_USABLE` of the total (the rest stays with the system and
other programs) and the summary names it, so "needs X, has Y" never reads as a contradiction.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import format_bytes

GIB = 2**30
RAM_OVERHEAD = 2 * GIB  # the worker process: Python, torch, tokenizer, activations
CONTEXT_TOKENS = 8192  # the context a fit counts a KV cache for (LM Studio's and Ollama's usual)
RAM_USABLE = 0.85  # the share of RAM the OS and other programs leave to us
TIGHT_RAM = 0.6  # above this share of usable RAM the fit is "tight"
# BF16 experts the loader converts when they do not fit (engine.formats.int_quant, groups of 64 with a
# bf16 scale and offset each): int8 is 1 + 4/64 bytes a weight, int4 1/2 + 4/64, of BF16's 2
HOST_STORE_FACTORS = {"int8": 17 / 32, "int4": 9 / 32}


@dataclass(frozen=True)
class ModelBytes:
    """What a model takes: its routed experts as stored, the rest as the loader holds it (BF16),
    its KV cache at the context counted, and whether its experts are floats the loader may convert."""

    expert_bytes: int
    resident_bytes: int
    kv_bytes: int
    convertible: bool  # BF16/F16 experts: int8/int4 in RAM where the floats do not fit


@dataclass(frozen=True)
class Fit:
    fits_in_ram: bool
    ram_needed_bytes: int  # as the loader would keep it (converted where that is what fits)
    gpu_cacheable_fraction: float | None  # of the routed experts; None without a GPU
    summary: str
    level: str  # "good", "tight" or "no": the colour cue
    usable_ram_bytes: int = 0  # what the estimate compares with
    stored_as: str = ""  # "int8"/"int4" where the experts would be converted (lossy)


def vram_headroom(vram_bytes: int) -> int:
    """Device memory the loader's auto budget keeps for activations and the allocator."""
    return max(GIB, vram_bytes // 10)


def estimate_fit(model: ModelBytes, ram_bytes: int, vram_bytes: int | None, context_tokens: int) -> Fit:
    """Where `model` would live with `ram_bytes` RAM and `vram_bytes` GPU memory (None: no GPU),
    a KV cache for `context_tokens` tokens counted in `model.kv_bytes`."""
    resident = model.resident_bytes + model.kv_bytes
    spare_vram = None if vram_bytes is None else vram_bytes - resident - vram_headroom(vram_bytes)
    on_gpu = spare_vram is not None and spare_vram >= 0
    usable = int(ram_bytes * RAM_USABLE)

    def needed(factor: float) -> int:  # on the GPU only the experts stay in RAM; else the rest too
        return int(model.expert_bytes * factor) + (0 if on_gpu else resident) + RAM_OVERHEAD

    forms = [("", 1.0), *(HOST_STORE_FACTORS.items() if model.convertible else ())]
    stored_as, factor = next(((name, f) for name, f in forms if needed(f) <= usable), ("", 1.0))
    ram_needed = needed(factor)
    fits = ram_needed <= usable
    fraction = None  # of the experts the GPU can cache
    if spare_vram is not None:
        fraction = min(1.0, spare_vram / max(int(model.expert_bytes * factor), 1)) if on_gpu else 0.0
    ram = f"about {format_bytes(usable)} of this computer's {format_bytes(ram_bytes)} RAM can hold a model"
    if not fits:
        smallest = needed(HOST_STORE_FACTORS["int4"]) if model.convertible else None
        also = f" (~{format_bytes(smallest)} even with its experts as int4, lossy)" if smallest else ""
        summary = (
            f"Too big: needs ~{format_bytes(ram_needed)} of RAM{also}; {ram} (the rest stays with the system)"
        )
        return Fit(False, ram_needed, fraction, summary, "no", usable)
    summary = _fits(ram_needed, ram_bytes, vram_bytes, on_gpu, fraction, resident, context_tokens)
    if stored_as:
        summary += f" (experts kept as {stored_as}, lossy: outputs differ slightly)"
    tight = stored_as or (vram_bytes is not None and not on_gpu) or ram_needed > TIGHT_RAM * usable
    return Fit(True, ram_needed, fraction, summary, "tight" if tight else "good", usable, stored_as)


def _fits(ram_needed, ram_bytes, vram_bytes, on_gpu, fraction, resident, context_tokens) -> str:
    ram = f"~{format_bytes(ram_needed)} of {format_bytes(ram_bytes)} RAM"
    if vram_bytes is None:
        return f"Fits (CPU only): {ram}"
    if not on_gpu:
        return (
            f"CPU only: the non-expert weights and the KV cache for {context_tokens // 1024}k tokens "
            f"(~{format_bytes(resident)}) exceed the GPU's {format_bytes(vram_bytes)}; {ram}"
        )
    return f"Fits: {ram}; the GPU caches {fraction:.0%} of the experts"


def machine_memory() -> tuple[int, int | None]:
    """This computer's RAM, and its first GPU's memory (None without one), in bytes."""
    import psutil
    import torch

    vram = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return int(psutil.virtual_memory().total), vram
