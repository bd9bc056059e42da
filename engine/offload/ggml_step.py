"""A decode or verification step's layers and head as ggml graphs (`--kernels ggml`).

Contract: `attach(lean)` gives a `LeanDecode` (engine.model.lean_decode) its layers' ends
(engine.offload.ggml_layer), a `Head` where its lm_head is a llama.cpp-kernel matrix without bias
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

Values: each layer's `whole`, then the head's, bit for bit (the same nodes, in one graph).
Why: a layer's graph costs ~30 µs of Python and a start of ggml's threads on top of its work;
one graph a step pays them once.
"""

from __future__ import annotations

import torch

from engine.offload import ggml_kernels, ggml_layer
from engine.offload.ggml_graphs import ThreadsKeptGraphs
from engine.offload.ggml_layer import rms, rms_normed, rows_in, weight_of
from engine.offload.ggml_library import loaded
from engine.offload.ggml_resident import GgmlLinear


def attach(lean) -> int:
    """Give `lean` its layers' ends, a `Head` and a `WholeStep` where they apply; how many layers
    got ends."""
    count = ggml_layer.attach(lean)
    if lean is not None and count:
        lean.head = Head.of(lean)
        lean.whole = WholeStep.of(lean)
    return count


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


class WholeStep:
    """A step's layers and head in one graph kept per token count, kept rows and cache buffers."""

    def __init__(self, ends: list, head: Head):
        self.ends, self.head = ends, head
        self._key = object()
        self._cached = ThreadsKeptGraphs(ggml_layer.KV_GRAPHS)  # they hold a cache's buffers

    @classmethod
    def of(cls, lean) -> WholeStep | None:
        ends = [layer.ends for layer in lean.layers]
        if lean.head is None or any(end is None or end.moe is None for end in ends):
            return None
        if len({end.kv_heads for end in ends}) != 1:  # one set of rows for the new keys of all layers
            return None
        return cls(ends, lean.head)

    def __call__(self, hidden: torch.Tensor, cos, sin, kv_cache, keep: int) -> torch.Tensor | None:
        caches = getattr(kv_cache, "layers", ())
        if getattr(kv_cache, "offloading", False) or self.head.hooked() or len(caches) != len(self.ends):
            return None
        return ggml_layer.run_layers(
            self.ends, hidden, cos, sin, caches, keep, self._cached, self._key, self.head
        )
