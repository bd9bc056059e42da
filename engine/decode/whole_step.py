"""A decode or verification step's layers and head as ggml graphs (`--kernels ggml`).

Contract: `attach(lean)` gives a `LeanDecode` (engine.decode.lean) its layers' ends
(engine.decode.layer_graph), a `Head` where its lm_head is a llama.cpp-kernel matrix without bias
and its final norm an RMS norm, and a `WholeStep` where every layer's ends also hold its MoE block
(`RoutedMlp`) and there is a head; it says how many layers got ends. Then, for float32 rows of
T ≤ MAX_FOLDED_QUERIES tokens:

    Head(hidden [1, n, H]) -> logits [n, V]: the final norm and lm_head, one graph kept per row
        count; None while something hooks the lm_head
    WholeStep(hidden, cos, sin, kv_cache, keep) -> logits [keep, V] of the last `keep` rows:
        every layer's `whole` nodes chained, the last layer on the kept rows, and the head, in
        one graph kept per token count, kept rows and cache buffers (llama.cpp's one graph a
        step); None where any layer's `whole` may not run, or the layers' caches do not hold as
        many positions in as large buffers (the step then goes layer by layer)
    WholeStep.of_ids(ids [1, T], cos, sin, kv_cache, keep) -> the same from the int32 token
        ids (`ids(tokens)`: None where one lies outside the table), looked up in the graph too
        where the model's embedding is an `Embedding` (a float32 `nn.Embedding` or a float32
        `GgmlEmbedding`) and nothing hooks it (`embeds()`): the table's rows as ggml dequantizes
        them, which are the module's (tested); None where the step may not run in one graph, and
        then `embedding(ids)` gives their rows `[1, T, H]` from a small graph of their own

Values: each layer's `whole`, then the head's, bit for bit (the same nodes, in one graph).
Why: a layer's graph costs Python and a start of ggml's threads on top of its work; one graph a
step pays them once. The embedding's module call costs more than a node, a large vocabulary's
`GgmlEmbedding` most (it dequantizes its row in Python); in the graph it is one node. Graphs
taking ids and graphs taking rows are kept apart: either one's inputs are garbage to the other.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine.decode import layer_graph as ggml_layer
from engine.decode.graph_chain import last_ran, rms_normed, routes_alike, rows_in, run_layers, weight_of
from engine.decode.layer_graph import rms
from engine.decode.one_token import OneTokenStep
from engine.decode.row_views import Row
from engine.ggml import kernels as ggml_kernels
from engine.ggml.graphs import ThreadsKeptGraphs
from engine.ggml.library import loaded
from engine.resident.ggml_embedding import GgmlEmbedding
from engine.resident.ggml_linear import GgmlLinear

_F32, _I32 = (int(GGMLQuantizationType[name]) for name in ("F32", "I32"))
_ONE_TOKEN = "one token"  # this thread's `OneTokenStep` in the graphs' buffers


def attach(lean) -> WholeStep | None:
    """Give `lean`'s layers their ggml ends and `lean` a `Head` where they apply; the model's
    `WholeStep` where every layer's ends hold its MoE block and there is a head (`lean` then
    looks its tokens up in ggml too), else None."""
    if lean is None or not ggml_layer.attach(lean):
        return None
    lean.head = Head.of(lean)
    whole = WholeStep.of(lean)
    if whole is not None:
        lean.embedding = whole.embedding
    return whole


class Head:
    """The final norm and lm_head of a few float32 rows in one graph kept per row count."""

    def __init__(self, norm: tuple[torch.Tensor, float], lm_head: GgmlLinear):
        self.norm, self.lm_head = norm, lm_head
        self._key = object()

    @classmethod
    def of(cls, lean) -> Head | None:
        lm_head, norm = lean.hf_model.lm_head, rms(lean.norm)
        if not isinstance(lm_head, GgmlLinear) or lm_head.bias is not None or norm is None:
            return None
        return cls(norm, lm_head)

    def hooked(self) -> bool:
        return bool(self.lm_head._forward_hooks or self.lm_head._forward_pre_hooks)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits `[n, V]` of `hidden [1, n, H]`; None while something hooks the lm_head."""
        if self.hooked():
            return None
        rows = hidden.reshape(hidden.shape[1], -1).contiguous()
        logits = torch.empty((rows.shape[0], self.lm_head.out_features))
        ggml_kernels.compute_kept(
            (self._key, rows.shape[0]),
            lambda context, bind: self.nodes(context, bind, rows_in(loaded(), context, bind, rows)),
            (rows,),
            (logits,),
            "the final norm and lm_head",
            8,
            8,
        )
        return logits

    def nodes(self, context, bind, x: int) -> int:
        """The logits `[V, n]` of the rows `x [H, n]`."""
        ggml = loaded()
        normed = rms_normed(ggml, context, bind, x, self.norm)
        return ggml.mul_mat(context, weight_of(ggml, context, bind, self.lm_head), normed)


class Embedding:
    """A token embedding's table as ggml reads it: a float32 `nn.Embedding`'s weight, or a float32
    `GgmlEmbedding`'s blocks, its rows dequantized by ggml's get_rows."""

    def __init__(self, module: nn.Module, table: torch.Tensor, ggml_type: int):
        self.module, self.table, self.ggml_type = module, table, ggml_type
        self.rows, self.width = module.num_embeddings, module.embedding_dim
        self.index = torch.arange(self.rows, dtype=torch.int32)  # a token's id where a graph reads it

    @classmethod
    def of(cls, module: nn.Module) -> Embedding | None:
        if type(module) is GgmlEmbedding and module.dtype == torch.float32:
            table, ggml_type = module.blocks, module.ggml_type
        elif type(module) is nn.Embedding and module.max_norm is None:
            table, ggml_type = module.weight, _F32
            if table.dtype != torch.float32:
                return None
        else:
            return None
        if table.device.type != "cpu" or not table.is_contiguous():
            return None
        return cls(module, table, ggml_type)

    def hooked(self) -> bool:
        return bool(self.module._forward_hooks or self.module._forward_pre_hooks)

    def ids(self, tokens: torch.Tensor) -> torch.Tensor | Row | None:
        """`tokens [1, T]` as the int32 ids the graph nodes look up: one token's its place in
        `index`; None where an id lies outside the table (ggml's get_rows would abort the
        process: the module's lookup raises)."""
        if tokens.numel() == 1:
            return self.token(int(tokens))
        inside = bool(((tokens >= 0) & (tokens < self.rows)).all())
        return tokens.to(torch.int32) if inside else None

    def token(self, token: int) -> Row | None:
        """One token id as `ids` gives it: its place in `index`, or None outside the table."""
        return Row.of(self.index, token, (1, 1)) if 0 <= token < self.rows else None

    def nodes(self, ggml, context, bind, ids: torch.Tensor) -> int:
        """The rows `[width, T]` of the int32 token ids `ids [T]`."""
        table = ggml.new_tensor_2d(context, self.ggml_type, self.width, self.rows)
        bind(table, self.table)
        index = ggml.new_tensor_1d(context, _I32, ids.numel())
        bind(index, ids)
        return ggml.get_rows(context, table, index)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows `[1, T, width]` of the int32 token ids `ids [1, T]` (inside the table), in a
        graph of their own kept per token count: a step going layer by layer (past the one-graph
        step's attention limit), cheaper than the module's call, a `GgmlEmbedding`'s most of all."""
        rows = torch.empty((1, ids.numel(), self.width))
        ggml_kernels.compute_kept(
            (self, ids.numel()),
            lambda context, bind: self.nodes(loaded(), context, bind, ids),
            (ids,),
            (rows,),
            "the token lookup",
            4,
            4,
        )
        return rows


class WholeStep:
    """A step's layers and head in one graph kept per token count, kept rows and cache buffers."""

    def __init__(self, ends: list, head: Head, embedding: Embedding | None):
        self.ends, self.head, self.embedding = ends, head, embedding
        self._key = object()
        self._cached = ThreadsKeptGraphs(ggml_layer.KV_GRAPHS)  # they hold a cache's buffers

    @classmethod
    def of(cls, lean) -> WholeStep | None:
        ends = [layer.ends for layer in lean.layers]
        if lean.head is None or any(end is None or end.moe is None for end in ends):
            return None
        if len({end.kv_heads for end in ends}) != 1:  # one set of rows for the new keys of all layers
            return None
        if not routes_alike(ends):
            return None
        return cls(ends, lean.head, Embedding.of(lean.decoder.embed_tokens))

    def embeds(self) -> bool:
        """Whether `of_ids` may look the tokens up in the graph now."""
        return self.embedding is not None and not self.embedding.hooked()

    def __call__(self, hidden: torch.Tensor, cos, sin, kv_cache, keep: int) -> torch.Tensor | None:
        return self._run(hidden, cos, sin, kv_cache, keep, None)

    def token(self, token: int) -> Row | None:
        """One token id as the embedding's graph nodes look it up (`embeds()` first)."""
        return self.embedding.token(token)

    def prepared(self) -> OneTokenStep | None:
        """The one-token step `decode` prepared on this thread's last one, or None."""
        return self._cached.buffers.get(_ONE_TOKEN)

    def decode(self, token: int, rotary, kv_cache) -> torch.Tensor | None:
        """The logits `[V]` of one token id after `kv_cache`'s positions (`embeds()` first): `of_ids`'
        with `reuse`; the step prepared on it (engine.decode.one_token) runs the next token's
        (`prepared`). None where `of_ids` declines."""
        ids = self.token(token)
        if ids is None:
            return None
        logits = self.of_ids(ids, *rotary.at(kv_cache.get_seq_length(), 1), kv_cache, 1, reuse=True)
        if logits is None:
            return None
        ran = last_ran(self._cached, (self._key, True))
        self._cached.buffers[_ONE_TOKEN] = OneTokenStep.of(self, rotary, ran)
        return logits[0]

    def of_ids(self, ids, cos, sin, kv_cache, keep: int, reuse: bool = False) -> torch.Tensor | None:
        """`__call__` from token ids; with `reuse`, the logits in a buffer the next such step
        rewrites (`run_layers`)."""
        return self._run(ids, cos, sin, kv_cache, keep, self.embedding, reuse)

    def _run(self, hidden, cos, sin, kv_cache, keep: int, embedding, reuse=False) -> torch.Tensor | None:
        caches = getattr(kv_cache, "layers", ())
        if getattr(kv_cache, "offloading", False) or self.head.hooked() or len(caches) != len(self.ends):
            return None
        # the graphs taking ids and those taking rows are kept apart: either one's inputs would be
        # garbage to the other (and ids read as rows can abort the process in get_rows)
        graphs, key, head = self._cached, (self._key, embedding is not None), self.head
        return run_layers(self.ends, hidden, cos, sin, caches, keep, graphs, key, head, embedding, reuse)
