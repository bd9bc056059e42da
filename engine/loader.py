"""Loading a Hugging Face MoE folder into an `OffloadedModel`.

The causal-LM module is built by transformers on the meta device; each MoE
block's `experts` is swapped for `OffloadedExperts` before any memory is
allocated, so routed experts exist only in the host store (read straight from
the safetensors, one expert at a time) and in the device cache. Everything else
is allocated on the device and filled from the checkpoint, renamed with
transformers' own conversion rules (Mixtral's `block_sparse_moe` → `mlp` …).

With `OffloadConfig.expert_dtype` int8 or int4 the routed experts are quantized as they are
read (opt-in: it changes the outputs), and the converted store is cached on disk
(`engine.store.disk_cache`) so the next load of the model skips the conversion.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import psutil
import torch
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.decode.cpu_attention import use_cpu_attention
from engine.decode.fused_norms import fuse_rms_norms
from engine.device_cache.eviction import make_policy
from engine.device_cache.expert_cache import ExpertCache
from engine.device_cache.transfer import make_transfer
from engine.errors import (
    BudgetTooSmallError,
    DeviceOutOfMemoryError,
    InvalidRequestError,
    UnsupportedArchitectureError,
)
from engine.formats.base import ExpertFormat, ModelExperts, StoredExperts
from engine.formats.gguf.repack import GGML_PACKINGS
from engine.formats.int_quant import QuantSpec
from engine.formats.layout import ExpertLayout
from engine.formats.native_experts import IntQuantFormat
from engine.formats.registry import detect_format
from engine.ggml import library as ggml_library
from engine.model.adapters import get_architecture
from engine.model.adapters.base import Architecture, DiskLayout
from engine.model.adapters.generic import bind, experts_per_token
from engine.model.checkpoint import Checkpoint
from engine.model.folder import load_tokenizer, open_checkpoint
from engine.model.gguf_file import GgufCheckpoint
from engine.model.kv_size import KV_RESERVE_TOKENS, kv_element_bytes, kv_reserve_bytes
from engine.moe.control import ExpertControl
from engine.moe.layer import OffloadedExperts, moe_blocks
from engine.moe.routing_trace import RoutingTrace
from engine.offloaded_model import OffloadedModel
from engine.resident.ggml_linear import GgmlLinear
from engine.resident.weights import load_resident
from engine.store.build import build_expert_store, pack_experts
from engine.store.disk_cache import StoreKey, load_or_build
from engine.store.host_store import ExpertStore
from engine.store.placement import AS_STORED, float_placement, ggml_computes, quantized_placement
from engine.store.staging import pinned_for_copies

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def load_model(
    model_dir: str | Path, config: OffloadConfig | None = None, progress: Progress | None = None
) -> OffloadedModel:
    """Load `model_dir` with its routed experts offloaded as `config` says."""
    config = config or OffloadConfig()
    config.validate()
    folder = Path(model_dir).expanduser()
    hf_config, expert_format, checkpoint = _open(folder)
    device = resolve_device(config.device)
    config = replace(config, kernels=resolve_kernels(config, expert_format, checkpoint, device))
    transfer = n_slots = None
    try:
        dtype = resolve_dtype(config.dtype, checkpoint, device, config.kernels)
        hf_model, arch, blocks = _skeleton(hf_config, dtype, folder, device)
        top_k = experts_per_token(hf_model.config)  # the language model's (a multimodal config nests it)
        model = ModelExperts.of(arch, blocks, dtype)
        store, experts = _expert_store(
            folder, expert_format, checkpoint, hf_model, model, device, config, progress
        )
        n_slots = _budget_slots(config, store, hf_model, blocks, device, top_k)
        transfer = make_transfer(device, config.sim_link_gbps, config.sim_latency_us, store)
        policy = make_policy(config.policy, top_k=top_k, alpha=config.mrs_alpha)
        cache = ExpertCache(store, n_slots, device, transfer, policy, in_place=config.sim_link_gbps is None)
        trace, control = _offload_experts(blocks, arch, cache)
        expert_names = _expert_tensor_names(experts.disk_layout, blocks, store.num_experts)
        load_resident(hf_model, checkpoint, expert_names, dtype, device, progress, config.kernels)
        if device.type == "cuda":  # a cache with a slot for every expert is filled now (fixed_slots)
            cache.fill(partial(progress, "experts to the GPU") if progress else None)
        tokenizer = (
            checkpoint.tokenizer() if isinstance(checkpoint, GgufCheckpoint) else load_tokenizer(folder)
        )
    except BaseException as err:
        if transfer is not None:
            transfer.close()  # else a failed load leaves the simulated link's thread running
        if isinstance(err, DeviceOutOfMemoryError) and n_slots is not None:
            err.cache_slots = n_slots  # the worker retries once with fewer slots
        raise
    finally:
        checkpoint.close()

    log.info(
        "Loaded %s (%s): %d MoE layers × %d experts (%s), %d cache slots, device %s",
        *(folder, arch.model_type, len(blocks), store.num_experts, config.expert_dtype, n_slots, device),
    )
    return OffloadedModel(
        path=folder,
        hf_model=hf_model,
        tokenizer=tokenizer,
        arch=arch,
        config=replace(config, kernels=_kernels_in_use(config.kernels, hf_model, store)),
        device=device,
        dtype=dtype,
        store=store,
        cache=cache,
        transfer=transfer,
        trace=trace,
        control=control,
        top_k=top_k,
        disk_layout=experts.name,
    )


def _open(folder: Path) -> tuple[object, ExpertFormat, object]:
    """The folder's config, the format its routed experts are in (the first that detects them) and
    its checkpoint as the resident weights are read through it."""
    hf_config, checkpoint = open_checkpoint(folder)
    expert_format = detect_format(hf_config, checkpoint)
    return hf_config, expert_format, expert_format.reader(hf_config, checkpoint)


def _expert_store(
    folder: Path,
    expert_format: ExpertFormat,
    checkpoint,
    hf_model: torch.nn.Module,
    model: ModelExperts,
    device: torch.device,
    config: OffloadConfig,
    progress: Progress | None,
) -> tuple[ExpertStore, StoredExperts]:
    """The host store of the routed experts, and the experts it was packed from.

    Built in pageable memory; on CUDA a small store is then pinned whole, a bigger one pinned in place
    or, past half the RAM or when the OS refuses, left pageable with its copies staged
    (engine.store.staging)."""
    if isinstance(checkpoint, GgufCheckpoint):
        checkpoint.bind(hf_model)  # its resident tensors by transformers' names
    report = (lambda done, total: progress("experts", done, total)) if progress else None
    if expert_format.kept_quantized:  # in the checkpoint's format, laid out for the CPU where it can be
        forms = (model.dtype, device, config.kernels, _in_place(config))
        placement = quantized_placement(expert_format, checkpoint, *forms)
        args = (expert_format, checkpoint, model, config.expert_dtype, placement)
        store, experts = build_expert_store(*args, pin=False, report=report)
    else:
        store, experts = _load_store(folder, expert_format, checkpoint, model, config, device, report)
    return (pinned_for_copies(store) if device.type == "cuda" else store), experts


def _in_place(config: OffloadConfig) -> bool:
    """Whether a CPU model's cache will use every expert where the store holds it (ExpertCache's
    `in_place`): no link simulated and a budget of every expert (the CPU's auto budget is all)."""
    budget = config.expert_budget
    return config.sim_link_gbps is None and budget.experts is None and budget.nbytes is None


def _skeleton(
    hf_config, dtype: torch.dtype, folder: Path, device: torch.device
) -> tuple[torch.nn.Module, Architecture, dict]:
    """transformers' model built on the meta device (no memory), with the modules it computes
    faster with on `device`, its architecture as the generic adapter reads it from the model, and
    its MoE blocks by layer."""
    arch = get_architecture(hf_config.model_type)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if device.type == "cpu":
        use_cpu_attention(hf_model)  # decode steps as two matmuls, not the flash kernel
    if device.type == "cuda":
        fuse_rms_norms(hf_model)  # a fused kernel a norm, not five more (model.fused_norms)
    arch = bind(arch, hf_model)
    blocks = moe_blocks(hf_model, arch)
    if not blocks:
        raise UnsupportedArchitectureError(f"{folder} has no layers with routed experts.")
    return hf_model.eval(), arch, blocks


def _offload_experts(blocks: dict, arch, cache: ExpertCache) -> tuple[RoutingTrace, ExpertControl]:
    """Replace every MoE block's experts with one served by `cache`; all share one control."""
    trace, control = RoutingTrace(), ExpertControl()
    for layer, (_, block) in blocks.items():
        block.experts = OffloadedExperts(block.experts, layer, cache, trace, control)
        getattr(block, arch.router_attr).register_forward_hook(trace.hook(layer))
    return trace, control


def _load_store(
    folder: Path,
    expert_format: ExpertFormat,
    checkpoint: Checkpoint,
    model: ModelExperts,
    config: OffloadConfig,
    device: torch.device,
    report: Callable[[int, int], None] | None,
) -> tuple[ExpertStore, StoredExperts]:
    """The host store of a float checkpoint's experts: packed as they are (as ggml rows where ggml
    computes them), or quantized to int8/int4 when asked or when the floats do not fit the host memory.

    A quantized store comes from the store cache when it holds one for this model."""
    experts = expert_format.open(checkpoint, model)  # finds the experts' tensors
    total = len(model.layers) * model.num_experts
    if report is not None:
        report(0, total)  # the stage starts (reading or converting can take long)
    quant = QuantSpec.from_dtype(config.expert_dtype)
    if quant is None:
        quant = host_store_quant(experts.layer_layout(model.layers[0]), total)
    if quant is not None:
        experts = IntQuantFormat(quant).open(checkpoint, model)
    pin = False  # pinned afterwards only if small (_expert_store)
    if quant is None:
        placement = float_placement(config.kernels, device, checkpoint.storage_dtype(), model)
        return pack_experts(experts, placement, pin, report, each_expert=True), experts
    build = partial(pack_experts, experts, AS_STORED, pin, report, each_expert=True)
    log.warning(
        "Routed experts are quantized to %s: outputs differ from the unquantized model's.", quant.name
    )
    layout = experts.layer_layout(model.layers[0])
    key = StoreKey(folder, model.dtype, quant)
    return load_or_build(key, layout, model.layers, model.num_experts, pin, build, report), experts


def host_store_quant(native: ExpertLayout, experts: int) -> QuantSpec | None:
    """None when the experts fit the free host memory at the checkpoint's precision; else the
    widest of int8 and int4 that fits, said in the log (outputs then differ slightly)."""
    available = psutil.virtual_memory().available
    room = available - max(2 * 2**30, available // 5)  # the rest of the process, the OS, other programs
    if native.nbytes * experts <= room:
        return None
    for spec in (QuantSpec(8), QuantSpec(4)):
        if native.quantized(spec).nbytes * experts <= room:
            log.warning(
                "The routed experts need %.1f GiB at the checkpoint's precision and %.1f GiB of memory is "
                "free: they are kept as %s instead (outputs differ slightly from the model's).",
                native.nbytes * experts / 2**30,
                available / 2**30,
                spec.name,
            )
            return spec
    raise DeviceOutOfMemoryError(
        f"The routed experts need {native.quantized(QuantSpec(4)).nbytes * experts / 2**30:.1f} GiB even "
        f"as int4, and {available / 2**30:.1f} GiB of memory is free. Close other programs or use a "
        "smaller model."
    )


def _budget_slots(config: OffloadConfig, store, hf_model, blocks, device: torch.device, top_k: int) -> int:
    """The slots the expert budget buys (an auto one: the device's free memory, see below)."""
    kv = (config.kv_dtype, config.context_length)
    auto = _auto_expert_nbytes(hf_model, blocks, device, *kv) if config.expert_budget.is_auto else None
    return cache_slots(config.expert_budget, store.expert_nbytes, store.total_experts, top_k, auto)


def cache_slots(
    budget: ExpertBudget, expert_nbytes: int, total_experts: int, top_k: int, auto_nbytes: int | None
) -> int:
    """Slots the budget buys, or an error when they cannot hold one token's top-k experts."""
    n_slots = budget.slots(expert_nbytes, total_experts, auto_nbytes)
    if n_slots >= top_k:
        return n_slots
    if auto_nbytes is not None:
        raise DeviceOutOfMemoryError(
            f"Only {max(auto_nbytes, 0) / 2**20:.0f} MiB of GPU memory is left for experts after the "
            f"model's resident weights and a headroom for activations; one token needs {top_k} experts "
            f"of {expert_nbytes / 2**20:.1f} MiB. Close other GPU programs, or use --device cpu."
        )
    raise BudgetTooSmallError(
        f"The expert budget ({budget}) holds {n_slots} expert(s) of "
        f"{expert_nbytes / 2**20:.2f} MiB, but one token needs {top_k} experts of a layer. "
        f"Raise --expert-budget to at least {_mib_rounded_up(top_k * expert_nbytes)} MiB "
        f"or {top_k} experts."
    )


def _mib_rounded_up(nbytes: int) -> str:
    """MiB with two decimals, rounded up: a minimum shown rounded down would still be too small."""
    return f"{math.ceil(nbytes / 2**20 * 100) / 100:.2f}"


def expert_headroom(total_nbytes: int) -> int:
    """Device memory an auto budget leaves for activations and the allocator (the KV cache apart)."""
    return max(2**30, total_nbytes // 10)


def _auto_expert_nbytes(
    hf_model, blocks, device: torch.device, kv_dtype: str = "auto", context_length: int | None = None
) -> int | None:
    """Free device memory an auto budget may give the expert cache, after the resident weights, the
    headroom and a KV cache of the context length (else KV_RESERVE_TOKENS; at most the model's
    window) in --kv-dtype; None on a CPU device."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    routed = {id(p) for _, block in blocks.values() for p in block.experts.parameters()}
    resident = sum(p.numel() * p.element_size() for p in hf_model.parameters() if id(p) not in routed)
    element = kv_element_bytes(kv_dtype, hf_model.dtype.itemsize)
    kv = kv_reserve_bytes(
        hf_model.config.get_text_config().to_dict(), element, context_length or KV_RESERVE_TOKENS
    )
    return free - resident - expert_headroom(total) - kv


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise InvalidRequestError(f"Unknown device {name!r}; use cpu, cuda or cuda:N.") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(
            f"--device {name} was asked for, but no CUDA GPU is available. Use --device cpu or auto."
        )
    return device


def resolve_kernels(
    config: OffloadConfig, expert_format: ExpertFormat, checkpoint, device: torch.device
) -> str:
    """`--kernels` for this load: "auto" is llama.cpp's ggml kernels on the CPU for what ggml
    computes as the checkpoint has it (`ggml_computes`) where its library runs here (said in one
    line where it does not), else the exact kernels. A safetensors model with a simulated link
    stands in for a GPU's: its experts keep the layout and kernels they have there."""
    if config.kernels != "auto":
        return config.kernels
    if device.type != "cpu" or not ggml_computes(expert_format, checkpoint):
        return "exact"
    if not isinstance(checkpoint, GgufCheckpoint) and not _in_place(config):
        return "exact"
    ready, why = ggml_library.available()
    if not ready:
        log.warning("llama.cpp's kernels cannot run here (%s): the model is computed by the exact ones", why)
        return "exact"
    return "ggml"


def _kernels_in_use(kernels: str, hf_model: torch.nn.Module, store: ExpertStore) -> str:
    """ "ggml" where ggml computes some of the model's matrices or of the store's experts; else
    "exact" (a float32 checkpoint asked for ggml's kernels), said in the log."""
    if kernels != "ggml" or any(isinstance(m, GgmlLinear) for m in hf_model.modules()):
        return kernels
    layouts = (store.layout_of(layer) for layer in store.layer_indices)
    if any(f.packing in GGML_PACKINGS for layout in layouts for f in layout.fields):
        return kernels
    log.warning("ggml's kernels cannot compute this model as it is held: the exact kernels do")
    return "exact"


def resolve_dtype(
    name: str, checkpoint: Checkpoint, device: torch.device, kernels: str = "exact"
) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if kernels == "ggml" and device.type == "cpu":
        # llama.cpp's numerics: float32 activations, the matrices in their blocks or float rows
        # (never upcast); without bfloat16 instructions torch's bfloat16 attention is much slower
        return torch.float32
    stored = checkpoint.storage_dtype()
    if device.type == "cuda" or stored != torch.float16:
        return stored  # bf16 and GGUF on the CPU too: fp32 takes twice the RAM and runs slower
    # CPU, float16 weights: torch's float16 CPU matmuls are slow; float32 when the host has room.
    fp32_bytes = sum(_numel(checkpoint, n) for n in checkpoint) * 4
    return torch.float32 if fp32_bytes < 0.5 * psutil.virtual_memory().available else stored


def _numel(checkpoint: Checkpoint, name: str) -> int:
    count = 1
    for dim in checkpoint.shape(name):
        count *= dim
    return count


def _expert_tensor_names(disk_layout: DiskLayout | None, blocks, num_experts: int) -> set[str]:
    """The checkpoint's routed-expert tensors (none to name for a GGUF file: its reader leaves them out)."""
    names = set()
    if disk_layout is None:
        return names
    for name, _ in blocks.values():
        experts = range(num_experts) if disk_layout.per_expert else range(1)
        for expert in experts:
            for group in disk_layout.names(name + ".", expert).values():
                names.update(group)
    return names
