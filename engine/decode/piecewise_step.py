"""A decode step as CUDA graph pieces, when the device cache can miss.

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
their slots into the layer's slot table (`Pieces.tables`: pinned host memory the device reads
where it lies, engine.device_cache.mapped_table — a host store, nothing launched); the next
piece's experts read the table (`batched_experts.forward_resident`: the fused kernels where the
layer has them). A layer's slots stay pinned until the next layer's are: by then the piece that
reads them is enqueued, and a copy that reuses one waits for it (`ExpertCache.release`'s marker).

Where the CPU computes misses (`cpu_experts`, HybriMoE's split: `Pieces.split`), a layer's
experts are a piece of their own: the host sends the misses the `HybridExecutor` gives the CPU to
the pool's zero row (the kernels add exactly nothing for them), enqueues the device's experts,
computes the CPU's from the host store meanwhile (the device runs the enqueued piece: no thread
is needed for the two to overlap), sends their sum up from pinned memory into the layer's partial,
and the next piece begins by adding it. The sum is the same experts' in another order.

Capture (`capture_pieces`): the body runs once; at each MoE layer's experts the current graph's
capture ends and the next one's begins (`Pieces.cut`), the router's ids kept as the piece's
output; all pieces share one memory pool, so a tensor one piece writes and the next reads keeps its
address. Replays (`PieceGraphs.replay`) alternate a piece and the host's work. Off CUDA, the
stand-in capture (`captured_step.eager_capture`) runs the body eagerly with the host's work inline
at each cut: the same tables, pins and reads (tests/engine/decode/test_piecewise_step.py).

The steps of a few tokens (a draft's verification) and SS-MoE's draft steps run in pieces as
`CapturedStep`'s do in one graph, each kind with its own pieces (their routes and inputs kept
with them: `PieceGraphs`); a layer pins the union of its tokens' experts (streaming beyond its
share, as the eager step does), so a step of more tokens than the cache has slots for their
routes is left to the eager path. The prefetch predictors (SP-MoE's, watching the drafts) are
called by the host between pieces, with the layer's input and routes, as the eager layer calls
them before its experts.

A score-based cache policy (MRS) sees each layer's router scores there too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.decode.captured_step import CapturedStep
from engine.decode.step_body import Buffers
from engine.device_cache.mapped_table import MappedTable
from engine.device_cache.pipeline import pinned_together
from engine.moe.batched_experts import forward_resident, resident_asked
from engine.moe.layer import group_by_expert


class Pieces:
    """What the pieces share: each MoE layer's slot table (`MappedTable`: the host writes it, the
    device reads it), the routers' ids a captured piece leaves and the experts' inputs, the slots
    pinned for the piece in flight, and the cut while capturing. With `split` (the CPU computes
    misses) each layer's experts are a piece of their own, and the CPU's share is added after."""

    def __init__(self, cache, layers: list[int], device: torch.device):
        experts = cache.store.num_experts
        self.cache, self.layers = cache, layers
        self.tables = {layer: MappedTable(experts, device) for layer in layers}
        self.routes: dict[int, torch.Tensor] = {}  # layer → its router's top-k ids, as captured
        # layer → (its experts module, their input, the routes' weights, the router's logits where the
        # cache's policy weighs experts by their scores)
        self.inputs: dict[int, tuple] = {}
        self.partials: dict[tuple, torch.Tensor] = {}  # (layer, T) → the CPU's share of its output `[T, H]`
        self.cut: Callable[[], None] | None = None  # while capturing: ends a piece, begins the next
        self.hybrid = None  # the `HybridExecutor` choosing the CPU's misses: `split` when set
        self.observers: tuple = ()  # the prefetch predictors watching the layers (`ExpertControl`)
        # while a step is captured: the runs around the capture bring its experts in, and the
        # replay that follows does again — the predictors and the policy see it then, once
        self.rehearsing = False
        self._pinned: list = []
        self._on_cpu: list[tuple[int, int]] = []  # (route, expert) the CPU computes for the layer
        self._top_k = 1  # the layer's routes a token
        self._staging: dict[tuple, torch.Tensor] = {}  # (layer, T) → pinned memory its CPU share goes up from
        self.plan_seconds, self.planned = 0.0, 0  # the host's planning time, and the layers planned

    @property
    def split(self) -> bool:
        return self.hybrid is not None

    def experts(self, module, hidden: torch.Tensor, top_k_index, top_k_weights) -> torch.Tensor:
        """`OffloadedExperts`' experts inside a step run in pieces: a cut where it is captured (the
        host brings the experts in between the pieces), else the host's work here; with `split`, a
        second cut (or the CPU's work here) before the CPU's share is added."""
        layer = module.layer
        scores = module.trace.logits.get(layer) if self.cache.policy.uses_scores else None
        self.inputs[layer] = (module, hidden, top_k_weights, scores)
        if self.cut is not None:
            self.routes[layer] = top_k_index
            self.cut()
        else:
            self.bring_in(layer, top_k_index)
        out = forward_resident(module, hidden, top_k_index, top_k_weights, self.tables[layer].device_view)
        if not self.split:
            return out
        # first met in the run before a capture: outside its memory pool
        partial = self.partials.setdefault((layer, len(hidden)), torch.zeros_like(hidden))
        if self.cut is not None:
            self.cut()
        else:
            self.add_cpu_share(layer)
        return out + partial

    def bring_in(self, layer: int, top_k_index: torch.Tensor) -> None:
        """`layer`'s routed experts pinned in slots (misses copied in) and their slots written into
        its table — those the CPU computes (`split`) sent to the pool's zero row; the previous
        layer's released (the piece reading them is enqueued). Its host time besides the routes'
        read and the copies' wait counts in `plan_seconds`."""
        ids = top_k_index.reshape(-1).tolist()  # the layer's host synchronisation
        _, hidden, _, scores = self.inputs[layer]
        for observe in () if self.rehearsing else self.observers:  # as the eager layer calls them
            observe(layer, hidden, top_k_index)
        if scores is not None and not self.rehearsing:  # a score-based policy sees the router's, too
            self.cache.policy.observe_scores(layer, scores.float().softmax(dim=-1).mean(dim=0).tolist())
        start = time.perf_counter()
        self.release()
        on_cpu = set(self._cpu_experts(layer, ids)) if self.split else set()
        experts = sorted(set(ids) - on_cpu)
        streaming = self.cache.streams(len(experts), layer)  # a verification's: beyond the layer's share
        self._pinned = pinned_together(self.cache, layer, experts, wait=False, streaming=streaming)
        rows = [slot.index for slot in self._pinned] + [self.cache.zero_row] * len(on_cpu)
        self.tables[layer].write(experts + sorted(on_cpu), rows)
        self._on_cpu = [(route, expert) for route, expert in enumerate(ids) if expert in on_cpu]
        self._top_k = top_k_index.shape[-1]
        self.plan_seconds += time.perf_counter() - start
        self.planned += 1
        for slot in self._pinned:  # on CUDA the compute stream waits; on a simulated link, the host
            self.cache.wait(slot)

    def _cpu_experts(self, layer: int, ids: list[int]) -> list[int]:
        """The missed experts the CPU computes for this step (`HybridExecutor`'s plan, over the
        routes each expert serves: a draft's steps are planned as a target's)."""
        return self.hybrid.cpu_experts(layer, group_by_expert([ids]))

    @torch.inference_mode()  # the partials are the step's (inference) tensors
    def add_cpu_share(self, layer: int) -> None:
        """The CPU's experts of `layer` (chosen by `bring_in`) computed from the host store while the
        device computes the others (their piece is enqueued), summed in route order and written
        into the layer's partial — zeros where the CPU has none."""
        module, hidden, weights, _ = self.inputs[layer]
        key = (layer, len(hidden))
        partial, on_cpu = self.partials[key], self._on_cpu
        if not on_cpu:
            partial.zero_()
            return
        x, scales = hidden.to("cpu"), weights.reshape(-1, 1).to("cpu")
        share = torch.zeros(x.shape, dtype=partial.dtype)
        for route, expert in on_cpu:  # a route's token: its position over top-k
            token = route // self._top_k
            views = self.cache.store.views(layer, expert)
            y = module._weighted(x[token : token + 1], scales[route : route + 1], views)
            share[token : token + 1] += y.to(share.dtype)
            self.cache.count_cpu_use()
        if partial.device.type == "cuda":  # through pinned memory: the host does not wait on the stream
            staging = self._staging.get(key)
            if staging is None:
                staging = self._staging[key] = torch.empty_like(partial, device="cpu").pin_memory()
            share = staging.copy_(share)
        partial.copy_(share, non_blocking=True)

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
    """A step's captured pieces: `replay` runs them in order, the host's work between them, over
    the routes and experts' inputs its capture left (each token count's graph has its own)."""

    def __init__(self, graphs: list, pieces: Pieces, routes: dict, inputs: dict):
        self.graphs, self.pieces, self.routes, self.inputs = graphs, pieces, routes, inputs

    def replay(self) -> None:
        pieces = self.pieces
        pieces.inputs = self.inputs
        graphs = iter(self.graphs)
        try:
            next(graphs).replay()
            for layer in pieces.layers:
                pieces.bring_in(layer, self.routes[layer])
                next(graphs).replay()  # the layer's experts (and, unless split, what follows)
                if pieces.split:
                    pieces.add_cpu_share(layer)  # while the device computes the others
                    next(graphs).replay()
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
        if len(graphs) != len(pieces.layers) * (1 + pieces.split) + 1:
            raise RuntimeError(f"{len(graphs)} pieces captured for {len(pieces.layers)} MoE layers")
        return PieceGraphs(graphs, pieces, dict(pieces.routes), dict(pieces.inputs)), out

    return capture


class PiecewiseStep(CapturedStep):
    """The step in pieces (see the module doc): `CapturedStep` over the pieces' slot tables."""

    path = "cuda-pieces"

    def __init__(self, model, body, capture=None):
        self.pieces = Pieces(model.cache, sorted(model.experts), model.device)
        self.top_k = model.top_k
        super().__init__(model, body, capture or capture_pieces(self.pieces))

    @classmethod
    def of(cls, model, whole: CapturedStep | None, capture=None) -> PiecewiseStep | None:
        """The pieces of `model` where its whole step could be captured (`whole`, whose body they
        share) and every MoE layer computes from a slot table; else None."""
        if whole is None or not all(resident_asked(experts) for experts in model.experts.values()):
            return None
        return cls(model, whole.body, capture)

    def refusal(self, kv_cache, count: int = 1) -> str:
        if self.cache.holds_all:
            return "the device cache holds every expert (the step is one graph)"
        if count * self.top_k > self.cache.n_slots:
            return f"{count} tokens may route to more of a layer's experts than the cache has slots"
        return super().refusal(kv_cache, count, budgeted=True)

    def step(self, token: int, kv_cache) -> torch.Tensor | None:
        hybrid = self.control.hybrid
        hybrid = hybrid if hybrid is not None and hybrid.active else None
        if (hybrid is None) != (self.pieces.hybrid is None):
            self._graphs.clear()  # the pieces are cut otherwise: captured again
        self.pieces.hybrid, self.pieces.observers = hybrid, self.control.observers
        try:
            with self.control.installed(pieces=self.pieces):
                return super().step(token, kv_cache)
        finally:
            self.pieces.release()  # the last layer's slots: its experts' piece is enqueued

    def _tables(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.pieces.tables[layer].device_view for layer in self.moe_layers)

    def _captured(self, buffers: Buffers, tables: tuple, token, past: int):
        """`CapturedStep._captured`, the cache's counters as they were and nothing observed: the
        runs around a capture bring the step's experts in, and its first replay counts them."""
        counters = self.cache.stats.phases[self.cache.phase]
        hits, misses, cpu = counters.hits, counters.misses, counters.cpu_computed
        self.pieces.rehearsing = True
        try:
            return super()._captured(buffers, tables, token, past)
        finally:
            self.pieces.rehearsing = False
            self.pieces.release()
            counters.hits, counters.misses, counters.cpu_computed = hits, misses, cpu

    def _hits_of(self, run: Callable, inputs: tuple) -> int:
        """The eager run before a capture (CUDA's lazy initialisations); the pieces count their own
        hits as they bring experts in."""
        run(*inputs)
        return 0
