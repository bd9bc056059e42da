"""A one-token decode step as CUDA graph pieces, when the device cache can miss.

Contract: `PiecewiseStep.of(model, whole)` is the pieces of an `OffloadedModel` whose step the
whole-step graph `whole` could hold (engine.decode.captured_step: they share its body), or None;
`refusal(kv_cache)` and `step(token, kv_cache)` as `CapturedStep`'s, taking the steps where the
device cache cannot hold every expert.

A step whose experts may be missing cannot be one graph: which experts a layer needs is known only
once its router has run, and a miss must be copied in before its experts run. So the step is cut
at each MoE layer's experts (SP-MoE and llama.cpp's split graphs cut there too): piece 0 runs from
the token to the first MoE layer's router; piece l + 1 runs that layer's experts, the rest of
the layer, the next layers' attention and the next MoE layer's router; the last piece ends with
the logits. Between two pieces the host reads the router's top-k ids (the layer's one host
synchronisation: layers + 1 a token with the sampled id), pins those experts in slots — the misses
copied in on the copy stream, the hits only looked up (`pipeline.pinned_together`) — and writes
their slots into the layer's slot table on the device (`Pieces.tables`); the next piece's experts
read the table (`batched_experts.forward_resident`: the fused kernels where the layer has them).
A layer's slots stay pinned until the next layer's are: by then the piece that reads them is
enqueued, and a copy that reuses one waits for it (`ExpertCache.release`'s marker).

Capture (`capture_pieces`): the body runs once; at each MoE layer's experts the current graph's
capture ends and the next one's begins (`Pieces.cut`), the router's ids kept as the piece's
output; all pieces share one memory pool, so a tensor one piece writes and the next reads keeps its
address. Replays (`PieceGraphs.replay`) alternate a piece and the host's work. Off CUDA, the
stand-in capture (`captured_step.eager_capture`) runs the body eagerly with the host's work inline
at each cut: the same tables, pins and reads (tests/engine/decode/test_piecewise_step.py).

Not yet here (issue 41): the mapped pinned table (the slots go up as two small copies), the CPU
computing misses while the GPU computes hits, pieces for verification and drafting, the score
policy's observation of router scores, prefetch predictors (a step they watch goes eagerly).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.decode.captured_step import Buffers, CapturedStep
from engine.device_cache.pipeline import pinned_together
from engine.moe.batched_experts import forward_resident, resident_asked


class Pieces:
    """What the pieces share: each MoE layer's slot table on the device, the routers' ids a
    captured piece leaves, the slots pinned for the piece in flight, and the cut while capturing."""

    def __init__(self, cache, layers: list[int], device: torch.device):
        experts = cache.store.num_experts
        self.cache, self.layers = cache, layers
        self.tables = {layer: torch.zeros(experts, dtype=torch.int64, device=device) for layer in layers}
        self.routes: dict[int, torch.Tensor] = {}  # layer → its router's top-k ids, as captured
        self.cut: Callable[[], None] | None = None  # while capturing: ends a piece, begins the next
        self._pinned: list = []
        self.plan_seconds, self.planned = 0.0, 0  # the host's planning time, and the layers planned

    def experts(self, module, hidden: torch.Tensor, top_k_index, top_k_weights) -> torch.Tensor:
        """`OffloadedExperts`' one-token experts inside a step run in pieces: a cut where it is
        captured (the host brings the experts in between the pieces), else the host's work here."""
        if self.cut is not None:
            self.routes[module.layer] = top_k_index
            self.cut()
        else:
            self.bring_in(module.layer, top_k_index)
        return forward_resident(module, hidden, top_k_index, top_k_weights, self.tables[module.layer])

    def bring_in(self, layer: int, top_k_index: torch.Tensor) -> None:
        """`layer`'s routed experts pinned in slots (misses copied in) and their slots written into
        its table; the previous layer's released (the piece reading them is enqueued). Its host
        time besides the routes' read and the copies' wait counts in `plan_seconds`."""
        experts = sorted(set(top_k_index.reshape(-1).tolist()))  # the layer's host synchronisation
        start = time.perf_counter()
        self.release()
        self._pinned = pinned_together(self.cache, layer, experts, wait=False)
        table = self.tables[layer]
        rows = torch.tensor([slot.index for slot in self._pinned]).to(table.device, non_blocking=True)
        table.index_copy_(0, torch.tensor(experts).to(table.device, non_blocking=True), rows)
        self.plan_seconds += time.perf_counter() - start
        self.planned += 1
        for slot in self._pinned:  # on CUDA the compute stream waits; on a simulated link, the host
            self.cache.wait(slot)

    @property
    def plan_us_per_layer(self) -> float | None:
        """The planner's mean host time a layer (µs): release, pin, issue the misses' copies, write
        the table — O(top-k) a layer."""
        return 1e6 * self.plan_seconds / self.planned if self.planned else None

    def release(self) -> None:
        for slot in self._pinned:
            self.cache.release(slot)
        self._pinned = []


class PieceGraphs:
    """A step's captured pieces: `replay` runs them in order, the host's work between them."""

    def __init__(self, graphs: list, pieces: Pieces):
        self.graphs, self.pieces = graphs, pieces

    def replay(self) -> None:
        pieces = self.pieces
        try:
            self.graphs[0].replay()
            for layer, graph in zip(pieces.layers, self.graphs[1:], strict=True):
                pieces.bring_in(layer, pieces.routes[layer])
                graph.replay()
        finally:
            pieces.release()


def capture_pieces(pieces: Pieces):
    """A `Capture` (engine.moe.cuda_graphs) of a step in pieces on CUDA: one run on a side stream
    with the host's work inline (lazy initialisations happen outside the capture, as in
    `cuda_capture`), then the body captured on that stream, a new graph begun at each cut, every
    graph in `pool`; `thread_local`: the transfer engine's thread may query its events meanwhile."""

    def capture(fn, inputs: tuple, pool) -> tuple[PieceGraphs, torch.Tensor]:
        device = inputs[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graphs = [torch.cuda.CUDAGraph()]

        def cut() -> None:
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool, capture_error_mode="thread_local")

        with torch.cuda.stream(side):
            fn(*inputs)
            pieces.release()
            graphs[0].capture_begin(pool=pool, capture_error_mode="thread_local")
            pieces.cut = cut
            try:
                out = fn(*inputs)
            finally:
                pieces.cut = None
                graphs[-1].capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        if len(graphs) != len(pieces.layers) + 1:
            raise RuntimeError(f"{len(graphs)} pieces captured for {len(pieces.layers)} MoE layers")
        return PieceGraphs(graphs, pieces), out

    return capture


class PiecewiseStep(CapturedStep):
    """The step in pieces (see the module doc): `CapturedStep` over the pieces' slot tables."""

    path = "cuda-pieces"

    def __init__(self, model, body, capture=None):
        self.pieces = Pieces(model.cache, sorted(model.experts), model.device)
        super().__init__(model, body, capture or capture_pieces(self.pieces))

    @classmethod
    def of(cls, model, whole: CapturedStep | None, capture=None) -> PiecewiseStep | None:
        """The pieces of `model` where its whole step could be captured (`whole`, whose body they
        share) and every MoE layer computes from a slot table; else None."""
        if whole is None or not all(resident_asked(experts) for experts in model.experts.values()):
            return None
        return cls(model, whole.body, capture)

    def refusal(self, kv_cache) -> str:
        if self.cache.holds_all:
            return "the device cache holds every expert (the step is one graph)"
        if self.control.hybrid is not None:
            return "the CPU computes misses (HybriMoE), which the pieces do not do yet"
        return super().refusal(kv_cache, budgeted=True)

    def step(self, token: int, kv_cache) -> torch.Tensor | None:
        try:
            with self.control.installed(pieces=self.pieces):
                return super().step(token, kv_cache)
        finally:
            self.pieces.release()  # the last layer's slots: its experts' piece is enqueued

    def _tables(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.pieces.tables[layer] for layer in self.moe_layers)

    def _captured(self, buffers: Buffers, tables: tuple, token: int, past: int):
        """`CapturedStep._captured`, the cache's counters as they were: the runs around a capture
        bring the token's experts in, and its first replay counts them."""
        counters = self.cache.stats.phases[self.cache.phase]
        hits, misses = counters.hits, counters.misses
        try:
            return super()._captured(buffers, tables, token, past)
        finally:
            self.pieces.release()
            counters.hits, counters.misses = hits, misses

    def _hits_of(self, inputs: tuple) -> int:
        """The eager run before a capture (CUDA's lazy initialisations); the pieces count their own
        hits as they bring experts in."""
        self._run(*inputs)
        return 0
