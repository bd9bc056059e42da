"""A standard layer's work before and after its attention as ggml graphs (`--kernels ggml`).

Contract: `attach(lean)` gives each layer of a `LeanDecode` (engine.decode.lean) whose parts
allow it an `AttentionEnds`, and says how many layers got one (engine.decode.whole_step adds a
head and the one graph a step). A layer qualifies when ggml's graphs can be kept here, its four
projections are llama.cpp-kernel matrices without bias (`GgmlLinear`), its norms are RMS norms
(torch's `rms_norm` gives their values: the lean step's probe) and the family's rotary function
is the rotate-half rotation of the whole head (asked of it on a probe). Then, for float32
activations of T tokens:

    inputs(hidden, cos, sin) -> query [1, H, T, D], key and value [1, KV, T, D]
        input norm, q/k/v products, q/k norms, rotation by the rotary module's cos and sin
    outputs(attended, hidden) -> (hidden + o_proj(attended), post-attention norm of that)
    finish(attended, hidden, rows) -> the layer's output for its last `rows` positions
        `outputs` and the MoE block's routing and experts (engine.decode.moe_graph) in one graph,
        where the block allows it this step; else None (`outputs`, then the block's module)
    whole(hidden, cos, sin, cache, rows) -> the same, with `inputs` and the attention in the graph
        too: the new keys and values written into the layer's `GrowingLayer` cache where it keeps
        them (`room`/`written`) and ggml's flash attention over it (llama.cpp's decode graph for
        the layer); None before the cache holds a prompt, past `GRAPH_ATTENTION_POSITIONS`, or
        where `finish` would be None; `room(cache, tokens)` says so and `layer_nodes` are its
        nodes, which engine.decode.graph_chain's `run_layers` chains (one layer here, every
        layer in engine.decode.whole_step)

each one ggml graph kept per token count (engine.ggml.graphs; `whole`'s per cache buffer
too), where the lean step took ~25 torch operators and four ggml calls for the ends, ~15 and a
host round trip for the routes, ~12 for the attention and the cache's update. Values: ggml's;
its products quantize their activations to 8 bits as every `--kernels ggml` product does,
and its norms and rotation round in float32 in another order than torch's (~1e-7 relative, which
the 8-bit rounding of the next product can carry to ~1% of a value: llama.cpp's own numerics).
`inputs` and `outputs` (and whole_step's head) compute row by row whatever the token count where the
matrices keep the file's rows; interleaved matrices (engine.ggml.interleave) from 4 rows on,
and `finish`'s experts and router, round a batch of rows as llama.cpp's batch does (~1e-6
relative); `whole`'s attention sums in flash attention's order, not torch's (~1e-7 relative).
"""

from __future__ import annotations

import functools
import weakref

import torch

from engine.decode.graph_chain import F32, angles, rms_normed, rows_in, run_layers, weight_of
from engine.decode.moe_graph import RoutedMlp
from engine.ggml import kernels as ggml_kernels
from engine.ggml.graphs import Tensor, ThreadsKeptGraphs
from engine.ggml.library import loaded
from engine.model.kv_cache import GrowingLayer
from engine.resident.ggml_linear import GgmlLinear

# ggml's flash attention over float32 keys and values walks each query head over each position;
# torch's two matmuls fold a key head's query heads together: past this many positions they are
# faster, and the gap grows with the cache's length
GRAPH_ATTENTION_POSITIONS = 256
KV_GRAPHS = 4  # graphs over a cache's buffers kept at a time: a new or grown cache makes new ones


def attends_in_graph(cached: int, tokens: int) -> bool:
    """Whether a step of `tokens` after `cached` positions attends in the graph (ggml's flash
    attention), not past `GRAPH_ATTENTION_POSITIONS`."""
    return cached + tokens <= GRAPH_ATTENTION_POSITIONS


_TENSORS = _NODES = 64  # a graph's tensors and nodes: the inputs graph has ~35


def _gone() -> None:  # a dead reference
    return None


def attach(lean) -> int:
    """Give each layer of `lean` that qualifies its `AttentionEnds`; how many got one."""
    if lean is None or not ggml_kernels.kept_graphs_work() or not _whole_head_rotation(lean):
        return 0
    for layer in lean.layers:
        layer.ends = AttentionEnds.of(layer)
    return sum(layer.ends is not None for layer in lean.layers)


class AttentionEnds:
    def __init__(self, layer, norms: dict[str, tuple[torch.Tensor, float] | None]):
        self.layer, self.norms = layer, norms
        self.heads = layer.q_proj.out_features // layer.head_dim
        self.kv_heads = layer.k_proj.out_features // layer.head_dim
        self._key = object()  # this layer's graphs, whatever memory is freed and reused around it
        self._fitting = (_gone, _gone)  # the cache buffers `room` checked last
        self._cached = ThreadsKeptGraphs(KV_GRAPHS)  # `whole`'s: they hold a cache's buffers
        self.moe = RoutedMlp.of(layer.mlp)  # the block's routing and experts in the output graph
        # tensors and nodes of the layer's part of a `run_layers` graph
        self.graph_size = 2 * _TENSORS + (0 if self.moe is None else 3 * self.moe.top_k)

    @classmethod
    def of(cls, layer) -> AttentionEnds | None:
        projections = (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)
        if not all(isinstance(p, GgmlLinear) and p.bias is None for p in projections):
            return None
        norms = {"input": rms(layer.input_norm), "post": rms(layer.post_norm)}
        for name, norm in (("q", layer.q_norm), ("k", layer.k_norm)):
            norms[name] = None if norm.norm is None else rms(norm.norm)
            if norm.norm is not None and norms[name] is None:
                return None
        if norms["input"] is None or norms["post"] is None:
            return None
        return cls(layer, norms)

    def inputs(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Query, key and value of `hidden [1, T, H]`'s tokens, rotated, as the attention takes them."""
        tokens, dim = hidden.shape[1], self.layer.head_dim
        rows = hidden.reshape(tokens, -1)
        cos, sin = cos.reshape(tokens, dim).contiguous(), sin.reshape(tokens, dim).contiguous()
        query = torch.empty((1, tokens, self.heads, dim))
        key, value = (torch.empty((1, tokens, self.kv_heads, dim)) for _ in range(2))
        ggml_kernels.compute_kept(
            (self._key, "inputs", tokens),
            lambda context, bind: self._inputs_graph(context, bind, rows, cos, sin),
            (rows, cos, sin),
            (query, key, value),
            "a layer's attention inputs",
            _TENSORS,
            _NODES,
        )
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def outputs(self, attended: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`hidden` + o_proj(`attended` [1, T, H·D]), its post-attention norm), each `[1, T, H]`."""
        tokens = hidden.shape[1]
        attended, rows = attended.reshape(tokens, -1).contiguous(), hidden.reshape(tokens, -1)
        summed, normed = torch.empty_like(rows), torch.empty_like(rows)
        ggml_kernels.compute_kept(
            (self._key, "outputs", tokens),
            lambda context, bind: self._outputs_graph(context, bind, attended, rows, tokens),
            (attended, rows),
            (summed, normed),
            "a layer's attention output",
            _TENSORS,
            _NODES,
        )
        return summed.view(hidden.shape), normed.view(hidden.shape)

    def _inputs_graph(self, context, bind, rows, cos, sin):
        hidden = rows_in(loaded(), context, bind, rows)
        return self._inputs_nodes(context, bind, hidden, angles(context, bind, cos, sin))

    def _inputs_nodes(self, context, bind, hidden: int, angles: tuple[int, int]):
        """Query `[D, H, T]`, key and value `[D, KV, T]` of the rows `hidden [H, T]`, rotated by
        `angles` (cos, sin `[D, 1, T]`)."""
        ggml, layer = loaded(), self.layer
        tokens = Tensor.from_address(hidden).ne[1]
        x = rms_normed(ggml, context, bind, hidden, self.norms["input"])
        query = self._heads(context, bind, layer.q_proj, x, self.norms["q"], layer.q_norm.per_head, tokens)
        key = self._heads(context, bind, layer.k_proj, x, self.norms["k"], layer.k_norm.per_head, tokens)
        value = ggml.mul_mat(context, weight_of(ggml, context, bind, layer.v_proj), x)
        return _rotated(ggml, context, query, *angles), _rotated(ggml, context, key, *angles), value

    def _heads(self, context, bind, projection, x, norm, per_head: bool, tokens: int) -> int:
        """A projection's heads `[D, heads, T]` (ggml's order), normed as the family norms them."""
        ggml, dim = loaded(), self.layer.head_dim
        projected = ggml.mul_mat(context, weight_of(ggml, context, bind, projection), x)
        if norm is not None and not per_head:  # the whole projection (OLMoE)
            projected = rms_normed(ggml, context, bind, projected, norm)
        heads = ggml.reshape_3d(context, projected, dim, projection.out_features // dim, tokens)
        return rms_normed(ggml, context, bind, heads, norm) if norm is not None and per_head else heads

    def finish(self, attended: torch.Tensor, hidden: torch.Tensor, rows: int) -> torch.Tensor | None:
        """The layer's output `[1, rows, H]` for the last `rows` of `hidden`'s positions where its
        MoE block routes inside ggml this step (`RoutedMlp.takes`): `outputs` and the block in one
        graph. None where it may not (`outputs`, then the block's module)."""
        moe = self.moe
        if moe is None or not moe.takes():
            return None
        tokens = hidden.shape[1]
        attended, inputs = attended.reshape(tokens, -1).contiguous(), hidden.reshape(tokens, -1)
        out = torch.empty((rows, inputs.shape[1]))
        chosen = torch.empty((rows, moe.top_k), dtype=torch.int32)
        logits = torch.empty((rows, moe.num_experts))
        ggml_kernels.compute_kept(
            (self._key, "finish", tokens, rows),
            lambda context, bind: self._finish_graph(context, bind, attended, inputs, rows),
            (attended, inputs),
            (out, chosen, logits),
            "a layer's attention output and experts",
            _TENSORS + 3 * moe.top_k,
            _NODES + 3 * moe.top_k,
        )
        moe.used(chosen, logits)
        return out.view(1, rows, -1)

    def whole(self, hidden: torch.Tensor, cos, sin, cache, rows: int) -> torch.Tensor | None:
        """The layer's output `[1, rows, H]` for the last `rows` of `hidden`'s T positions, its
        attention in the graph too: the new keys and values written into `cache` (a `GrowingLayer`
        holding the positions before them) and attended with ggml's flash attention over those
        and the new ones up to each token's own (the causal rule of transformers' sdpa mask).
        None where this step may not (`inputs`, torch's attention, `finish`)."""
        out = run_layers([self], hidden, cos, sin, [cache], rows, self._cached, self._key)
        return None if out is None else out.view(1, rows, -1)

    def room(self, cache, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`cache`'s key and value buffers with room for `tokens` more, where `whole` may run this
        step: the MoE block in ggml (`RoutedMlp.takes`) and a float32 `GrowingLayer` holding a
        prompt, of at most `GRAPH_ATTENTION_POSITIONS` positions with the new ones."""
        if self.moe is None or type(cache) is not GrowingLayer:
            return None
        if not attends_in_graph(cache.get_seq_length(), tokens) or not self.moe.takes():
            return None
        room = cache.room(tokens)
        fitting = self._fitting
        if room is None or (room[0] is fitting[0]() and room[1] is fitting[1]()):
            return room  # the buffers of the last steps, checked then
        shape = (self.kv_heads, self.layer.head_dim)  # of [1, KV, capacity, D] float32 buffers
        if any(b.dtype != torch.float32 or b.shape[1::2] != shape for b in room):
            return None
        self._fitting = tuple(weakref.ref(buffer) for buffer in room)  # not keeping a dropped cache
        return room

    def layer_nodes(self, context, bind, hidden: int, shared: tuple, room, rows: int):
        """`whole`'s nodes on the rows `hidden [H, T]`, with a step's `shared` inputs (graph_chain's
        `step_inputs`) and the cache's buffers `room`: the output rows, the experts chosen, the
        router's logits."""
        ggml, dim, tokens = loaded(), self.layer.head_dim, Tensor.from_address(hidden).ne[1]
        angles, index, seen = shared[:2], shared[2], shared[3]
        query, key, value = self._inputs_nodes(context, bind, hidden, angles)
        cached, heads = [], self.kv_heads
        for new, buffer in zip((key, value), room, strict=True):  # [1, KV, capacity, D]
            capacity = buffer.shape[2]
            rows_of = ggml.new_tensor_2d(context, F32, dim, heads * capacity)  # (head, position) rows
            bind(rows_of, buffer)
            new_rows = ggml.reshape_2d(context, new, dim, heads * tokens)
            stored = ggml.set_rows(context, rows_of, new_rows, index)
            cached.append(ggml.view_3d(context, stored, dim, capacity, heads, dim * 4, capacity * dim * 4, 0))
        attended = ggml.flash_attn_ext(
            context, ggml.permute(context, query, 0, 2, 1, 3), *cached, seen, self.layer.scaling, 0.0, 0.0
        )  # [D, heads, T]
        attended = ggml.reshape_2d(context, attended, dim * self.heads, tokens)
        return self._finished(context, bind, attended, hidden, tokens, rows)

    def _outputs_graph(self, context, bind, attended, rows, tokens: int):
        ggml = loaded()
        attended, rows = rows_in(ggml, context, bind, attended), rows_in(ggml, context, bind, rows)
        summed = self._summed(context, bind, attended, rows)
        return summed, rms_normed(ggml, context, bind, summed, self.norms["post"])

    def _finish_graph(self, context, bind, attended, inputs, rows: int):
        ggml = loaded()
        attended, residual = rows_in(ggml, context, bind, attended), rows_in(ggml, context, bind, inputs)
        return self._finished(context, bind, attended, residual, inputs.shape[0], rows)

    def _finished(self, context, bind, attended: int, residual: int, tokens: int, rows: int):
        """The layer's output for the last `rows` (o_proj, residual, post norm, MoE block,
        residual), the experts chosen and the router's logits."""
        ggml, width = loaded(), self.layer.o_proj.out_features
        summed = self._summed(context, bind, attended, residual)
        if rows < tokens:  # the last rows only (a prompt's last layer): contiguous float32 rows
            summed = ggml.view_2d(context, summed, width, rows, width * 4, (tokens - rows) * width * 4)
        normed = rms_normed(ggml, context, bind, summed, self.norms["post"])
        moe, chosen, logits = self.moe.nodes(ggml, context, bind, normed, rows)
        return ggml.add(context, summed, moe), ggml.cont(context, chosen), logits

    def _summed(self, context, bind, attended: int, residual: int) -> int:
        """`residual` + o_proj(`attended`), ggml tensors."""
        ggml = loaded()
        projected = ggml.mul_mat(context, weight_of(ggml, context, bind, self.layer.o_proj), attended)
        return ggml.add(context, residual, projected)


def _rotated(ggml, context, heads: int, cos: int, sin: int) -> int:
    """`heads · cos + rotate_half(heads) · sin`, `rotate_half(x) = [-x₂, x₁]` (x's two halves)."""
    view = Tensor.from_address(heads)
    half, count, tokens = view.ne[0] // 2, view.ne[1], view.ne[2]
    first, second = (
        ggml.view_3d(context, heads, half, count, tokens, view.nb[1], view.nb[2], offset)
        for offset in (0, half * 4)
    )
    rotated = ggml.concat(context, ggml.neg(context, second), first, 0)
    return ggml.add(context, ggml.mul(context, heads, cos), ggml.mul(context, rotated, sin))


def rms(norm) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a norm the lean step runs as torch's `rms_norm`, in float32; else None."""
    if not isinstance(norm, functools.partial) or norm.func is not torch.nn.functional.rms_norm:
        return None
    weight, eps = norm.keywords["weight"], norm.keywords["eps"]
    if weight.dtype != torch.float32 or not weight.is_contiguous() or weight.device.type != "cpu":
        return None
    return weight, float(eps)


def _whole_head_rotation(lean) -> bool:
    """Whether the family's rotary function is the rotate-half rotation of the whole head with the
    rotary module's cos and sin (as wide as a head): asked of it on a probe."""
    rotary = lean.decoder.rotary_emb
    dim = lean.layers[0].head_dim
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.numel() * 2 != dim:
        return False
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn((1, heads, 3, dim), generator=generator) for heads in (4, 2))
    cos, sin = (torch.randn((1, 3, dim), generator=generator) for _ in range(2))

    def rotate_half(x):
        return torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)

    got = lean.apply_rotary(q, k, cos, sin)
    wanted = (t * cos[:, None] + rotate_half(t) * sin[:, None] for t in (q, k))
    return all(torch.equal(a, b) for a, b in zip(got, wanted, strict=True))
