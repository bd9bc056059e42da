"""A GGUF's token embedding kept in its quantized blocks on the device.

A 150k–200k-token vocabulary's embedding is 0.6–1.2 GB in BF16 but a quarter of that in Q4_K:
on an 8 GB GPU the difference is hundreds of experts' worth of cache. A lookup touches only the
rows of the tokens it embeds, so `GgmlEmbedding` dequantizes just those (engine.formats.gguf.blocks,
bit for bit gguf's own dequantization) and the table never exists in BF16. The output head stays
dense: every decode step multiplies by all of it, and dequantizing it per step would cost more
than the memory is worth. Tied embeddings (the head is the same matrix) stay dense too. A BF16 or
F16 table is kept in its rows the same way when the model computes in float32 (`--kernels ggml`):
converting a looked-up row is exact, and the table never takes twice its bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.formats.gguf.blocks import dequantize
from engine.model.gguf_file import DENSE_TYPES

# Below this many parameters the BF16 table is small enough to keep dense (a 2048-wide table of
# 8k tokens is 32 MiB): the saving would not be worth a dequantization per lookup.
MIN_QUANTIZED_EMBEDDING = 16 * 2**20


class GgmlEmbedding(torch.nn.Module):
    """`nn.Embedding` over a `[vocab, row_bytes]` table of ggml blocks (non-persistent buffer)."""

    def __init__(self, vocab: int, dim: int, ggml_type: int, row_bytes: int, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = vocab, dim
        self.ggml_type, self.dtype = int(ggml_type), dtype
        self.register_buffer("blocks", torch.empty((vocab, row_bytes), dtype=torch.uint8), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):  # as nn.Embedding
            raise IndexError(f"token ids outside the embedding's {self.num_embeddings} rows")
        rows = dequantize(self.blocks[ids], self.ggml_type, (ids.numel(), self.embedding_dim), self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        name = GGMLQuantizationType(self.ggml_type).name
        return f"{self.num_embeddings}, {self.embedding_dim}, {name} blocks"


def keep_embedding_quantized(hf_model, tensor, dtype: torch.dtype) -> str | None:
    """Put a `GgmlEmbedding` in `hf_model` (on the meta device, filled by `fill_embedding`) when the
    GGUF's `token_embd` (`tensor`, a gguf reader tensor) is quantized (or floats narrower than
    `dtype`), big and not tied to the head; the name of the dense weight it replaces (not to be
    loaded), else None."""
    if tensor is None or hf_model.config.tie_word_embeddings:
        return None
    if tensor.tensor_type in DENSE_TYPES and GGML_QUANT_SIZES[tensor.tensor_type][1] >= dtype.itemsize:
        return None  # floats as wide as the compute dtype: an ordinary parameter costs no more
    dense = hf_model.get_input_embeddings()
    if dense.weight.numel() < MIN_QUANTIZED_EMBEDDING or getattr(dense, "embed_scale", None) is not None:
        return None
    vocab, dim = dense.weight.shape
    if tuple(tensor.data.shape) != (vocab, tensor.data.shape[-1]):
        return None  # not the layout expected: load it dense as before
    name = next(name for name, module in hf_model.named_modules() if module is dense)
    with torch.device("meta"):
        embedding = GgmlEmbedding(vocab, dim, tensor.tensor_type, int(tensor.data.shape[-1]), dtype)
    hf_model.set_input_embeddings(embedding)
    return f"{name}.weight"


def fill_embedding(hf_model, tensor, rows_at_once: int = 8192) -> None:
    """Copy the file's blocks into the (allocated) `GgmlEmbedding` of `hf_model`, a slice of rows
    at a time (the memory map is read-only: each slice is copied out of it, never the whole)."""
    blocks = hf_model.get_input_embeddings().blocks
    data = tensor.data.reshape(blocks.shape)
    with torch.no_grad():
        for start in range(0, blocks.shape[0], rows_at_once):
            rows = np.array(data[start : start + rows_at_once])
            blocks[start : start + rows_at_once].copy_(torch.from_numpy(rows))
