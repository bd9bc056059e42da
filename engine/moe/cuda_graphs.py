"""One CUDA graph a MoE layer: a one-token step's experts as one launch, not ~55 (opt-in).

With every expert on the device (`ExpertCache.holds_all`), a one-token step's experts go through
`batched_experts.forward_resident`: a slot-table lookup, a gather, the blocks dequantized, two batched
matmuls and a sum — about 55 kernels a layer for a Q4_K_M file, each launched from Python, and no
host synchronisation. Nothing in it depends on the host knowing the route, so it can be captured:
`ExpertGraphs.forward` captures each layer's computation once as a CUDA graph over static input
buffers, then copies the step's hidden state, routes and weights in, replays the graph and clones
its output: five launches a layer. Where the layer has the fused kernels (`moe.fused_experts`: two
launches, its `[K, I]` buffer allocated before the capture and kept), the graph holds those.

Captures share one memory pool: a layer's intermediates (the dequantized experts, ~200 MB at
Qwen3-30B-A3B's shapes) are dead once its replay ends, replays run one at a time on one stream, and
each graph's output buffer stays referenced, so no capture reuses it. A graph is captured again when
its layer's slot table changes (an expert left: `clear`, `resize`, a failed copy), when the hidden
dtype or the number of routes changes. Any error while capturing turns the graphs off for the model
(logged once) and the eager path goes on: the outputs are the same kernels' either way.

Off unless asked for (`ExpertControl.graphs`, `python -m engine.bench --expert-graphs`): not yet
measured on a GPU. `capture` is injectable so the buffer plumbing is tested without one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.moe.batched_experts import forward_resident

log = logging.getLogger(__name__)

Step = Callable[..., torch.Tensor]
# (step, static inputs, pool) -> (graph with .replay(), static output)
Capture = Callable[[Step, tuple[torch.Tensor, ...], object], tuple[object, torch.Tensor]]


@dataclass
class _Captured:
    graph: object
    table: torch.Tensor  # the slot table the graph reads
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # hidden [1, H], routes, weights [1, K]
    out: torch.Tensor


def cuda_capture(fn: Step, inputs: tuple[torch.Tensor, ...], pool) -> tuple:
    """`fn(*inputs)` captured as a CUDA graph in `pool`, after one run on a side stream (lazy
    initialisations — cuBLAS handles, lookup tables — happen outside the capture)."""
    device = inputs[0].device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the transfer engine's thread may query its events meanwhile
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn(*inputs)
    return graph, out


class ExpertGraphs:
    """The captured layers of one model (see the module doc)."""

    def __init__(self, capture: Capture = cuda_capture, pool: object | None = None):
        self._capture = capture
        self._pool = pool
        self._layers: dict[int, _Captured] = {}
        self.off_because: str | None = None  # why the graphs were turned off, if they were
        self.captures = 0

    def forward(
        self, module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, table
    ) -> torch.Tensor:
        """`batched_experts.forward_resident(module, …)`, by replaying `module.layer`'s graph."""
        if self.off_because is not None:
            return forward_resident(module, hidden, top_k_index, top_k_weights, table)
        captured = self._layers.get(module.layer)
        if captured is None or not _fits(captured, hidden, top_k_index, top_k_weights, table):
            try:
                captured = self._capture_layer(module, hidden, top_k_index, top_k_weights, table)
            except Exception as err:  # any capture failure: the eager path goes on
                self.off_because = f"{type(err).__name__}: {err}"
                self._layers.clear()
                log.warning("Expert CUDA graphs turned off: %s", self.off_because)
                return forward_resident(module, hidden, top_k_index, top_k_weights, table)
        for static, value in zip(captured.inputs, (hidden, top_k_index, top_k_weights), strict=True):
            static.copy_(value)
        captured.graph.replay()
        return captured.out.clone()

    def _capture_layer(self, module, hidden, top_k_index, top_k_weights, table) -> _Captured:
        self._layers.pop(module.layer, None)  # its buffers go back to the pool before the new capture
        if self._pool is None and self._capture is cuda_capture:
            self._pool = torch.cuda.graph_pool_handle()
        inputs = (hidden.clone(), top_k_index.clone(), top_k_weights.clone())

        def step(h: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return forward_resident(module, h, index, weights, table)

        graph, out = self._capture(step, inputs, self._pool)
        self.captures += 1
        captured = self._layers[module.layer] = _Captured(graph, table, inputs, out)
        return captured


def _fits(captured: _Captured, hidden, top_k_index, top_k_weights, table) -> bool:
    """Whether `captured` computes this call: the same table, shapes and dtypes."""
    return captured.table is table and all(
        static.shape == value.shape and static.dtype == value.dtype
        for static, value in zip(captured.inputs, (hidden, top_k_index, top_k_weights), strict=True)
    )
