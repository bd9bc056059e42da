"""A model's resident (non-expert) weights, read from its checkpoint onto the device.

Contract: `load_resident(hf_model, checkpoint, skip, dtype, device, progress, kernels)` allocates
every parameter of `hf_model` (built on the meta device, its routed experts already replaced by the
loader) on `device` and fills it from `checkpoint` under transformers' names and renamings,
skipping the expert tensors in `skip`; what the checkpoint lacks is a `MissingTensorsError`, a
shape it disagrees on a `CorruptCheckpointError`. A GGUF's big quantized token embedding stays in
its blocks (engine.resident.ggml_embedding), and with `--kernels ggml` on the CPU its quantized
matrices too (engine.resident.ggml_linear), as do a safetensors checkpoint's BF16/F16 matrices and
embedding, as ggml rows of the same numbers; on a GPU those of a type the fused GEMV reads
(engine.resident.device_blocks). On the CPU they lie on huge pages where the system
gives them (engine.huge_pages).
"""

from __future__ import annotations

import logging

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from engine import huge_pages
from engine.errors import CorruptCheckpointError, DeviceOutOfMemoryError, MissingTensorsError
from engine.formats.gguf.repack import GGML_FLOATS
from engine.model.checkpoint import Checkpoint
from engine.model.gguf_file import GgufCheckpoint
from engine.resident.device_blocks import fill_blocks, keep_linears_on_device
from engine.resident.ggml_embedding import fill_embedding, keep_embedding_quantized
from engine.resident.ggml_linear import fill_linears, keep_linears_quantized

log = logging.getLogger(__name__)

BLOCKS_ON = ("cuda",)  # devices where a GGUF's matrices stay in their blocks (engine.resident.device_blocks)


def load_resident(hf_model, checkpoint, skip: set[str], dtype, device, progress, kernels="exact") -> None:
    """The resident weights; a GGUF's big quantized token embedding stays in its blocks, and with
    `--kernels ggml` on the CPU its quantized matrices too (engine.resident.ggml_linear)."""
    gguf = isinstance(checkpoint, GgufCheckpoint)
    ggml = kernels == "ggml" and device.type == "cpu"  # a GGUF's blocks, or a checkpoint's BF16/F16 rows
    embed = (
        checkpoint.tensors.get("token_embd.weight") if gguf else _float_embedding(hf_model, checkpoint, ggml)
    )
    replaced = keep_embedding_quantized(hf_model, embed, dtype)
    linears = keep_linears_quantized(hf_model, checkpoint) if ggml else {}
    # on a GPU the matrices of a type the fused GEMV reads stay in their blocks there
    on_device = keep_linears_on_device(hf_model, checkpoint) if gguf and device.type in BLOCKS_ON else {}
    skipped = skip | set(linears) | set(on_device) | {replaced} - {None}
    _load_resident_weights(hf_model, checkpoint, skipped, device, progress)
    fill_linears(hf_model, linears)
    fill_blocks(hf_model, on_device, device)
    if on_device:
        log.info("%d matrices stay in their GGUF blocks on the GPU.", len(on_device))
    if replaced is not None:
        fill_embedding(hf_model, embed)
        log.info("The token embedding stays in its %s blocks (%s).", embed.tensor_type.name, replaced)


def _float_embedding(hf_model, checkpoint: Checkpoint, ggml: bool):
    """A safetensors checkpoint's token embedding as ggml rows of its BF16/F16 numbers where
    ggml's kernels compute the model (in float32: a looked-up row converts exactly); else None."""
    dense = hf_model.get_input_embeddings()
    if not ggml or dense is None:
        return None
    name = next(name for name, module in hf_model.named_modules() if module is dense)
    return checkpoint.quantized_tensor(f"{name}.weight", also=GGML_FLOATS)


def _load_resident_weights(hf_model, checkpoint: Checkpoint, skip: set[str], device, progress) -> None:
    """Allocate every non-expert parameter on `device` and fill it from the checkpoint."""
    try:
        hf_model.to_empty(device=device)
    except torch.OutOfMemoryError as err:
        raise DeviceOutOfMemoryError(
            "Out of device memory for the model's resident (non-expert) weights. "
            "This model needs a larger GPU, or use --device cpu."
        ) from err
    for tensor in (*hf_model.parameters(), *hf_model.buffers()):
        huge_pages.advise(tensor)  # before it is filled; the CPU reads the matrices every token
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    targets = dict(hf_model.state_dict(keep_vars=True))
    loaded: set[str] = set()
    names = [n for n in checkpoint if n not in skip]
    for done, name in enumerate(names, 1):
        target, _ = rename_source_key(name, renamings, converters, hf_model.base_model_prefix, targets)
        tensor = targets.get(target)
        if tensor is None:
            log.debug("Ignoring checkpoint tensor %s (no such parameter)", name)
            continue
        value = checkpoint.read(name, tensor.dtype)
        if value.shape != tensor.shape:
            raise CorruptCheckpointError(
                f"{name} has shape {tuple(value.shape)} but the model expects {tuple(tensor.shape)}; "
                "config.json and the weights disagree. Use the config.json that came with these weights."
            )
        with torch.no_grad():
            tensor.copy_(value)
        tensor._is_hf_initialized = True
        loaded.add(target)
        if progress is not None:
            progress("weights", done, len(names))
    tied = set(getattr(hf_model, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(targets) - loaded - tied - _non_persistent(hf_model))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MissingTensorsError(
            f"The checkpoint in {checkpoint.folder} lacks {len(missing)} tensor(s): {shown}. "
            "The download is incomplete or the folder mixes two models."
        )
    hf_model.initialize_weights()  # fills only what was not loaded: RoPE buffers and the like
    hf_model.tie_weights()


def _non_persistent(hf_model) -> set[str]:
    return {name for name, _ in hf_model.named_non_persistent_buffers()}
