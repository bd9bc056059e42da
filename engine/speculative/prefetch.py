"""Expert prefetching: predictors that guess the experts needed next, and the worker that loads them.

Policies (all in this module, so comparisons between them are honest):

- `none`: on-demand copies only (Mixtral-offloading's LRU).
- `next-layer`: while MoE layer l computes, its hidden state goes through router l+1
  and that layer's top-k experts are prefetched (AdapMoE-like).
- `hybrimoe`: impact-driven: the hidden state goes through the next three routers;
  experts are prefetched nearest layer first, then by routing weight (their impact on
  the output). Meant to run with the MRS cache policy, as in HybriMoE.
- `spmoe`: SP-MoE Alg. 1 during drafting. For each drafted token and each
  target MoE layer l <= cutoff, the experts verification will route to are
  predicted, and those not cached become one task on the prefetch queue. With a
  separate draft model, the draft's residual stream after attention at the draft
  layer of the same relative depth goes through the target's norm and router l;
  self and substitute drafts *are* the target's layers, so their own top-k routes
  are the prediction. When the cache is small enough that verification streams
  (`ExpertCache.streams`), drafting prefetches only into the spare stream slots,
  so no layer loses the experts it keeps (the cutoff is then the first layer),
  and during verification each streamed layer, once its own misses are issued,
  copies the experts the next layer's router picks from its input into those
  slots (`lookahead`): the link keeps working while the next layer's attention
  runs instead of waiting for its router.

`PrefetchWorker` is SP-MoE Alg. 2: one thread takes tasks off the queue and
issues each task's copies as one batch under the cache lock (evicting by the
cache policy; each slot records its own copy event, and compute waits on the
slots it uses, never on the whole link).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.device_cache.eviction import ExpertKey
from engine.device_cache.expert_cache import STREAM_DEPTH, ExpertCache
from engine.errors import InvalidRequestError
from engine.generation_config import PREFETCH_POLICIES
from engine.model.hf_calls import decoder_of
from engine.moe.layer import moe_blocks
from engine.speculative.draft_len import unique_experts

log = logging.getLogger(__name__)

HYBRIMOE_DEPTH = 3


IDLE_POLL_S = 1.0  # how often an idle worker looks whether it was closed
DRAIN_TIMEOUT_S = 60.0  # issuing a batch of prefetches takes milliseconds


class PrefetchWorker:
    """A thread that copies each queued task's experts into the cache as one batch."""

    def __init__(self, cache: ExpertCache):
        self.cache = cache
        self._tasks: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="expert-prefetch", daemon=True)
        self._thread.start()

    def submit(self, keys: Iterable[ExpertKey], phase: str, spare_only: bool = False) -> None:
        """Queue one task; `spare_only` is `ExpertCache.prefetch`'s."""
        keys = tuple(keys)
        if keys:
            self._tasks.put((keys, phase, spare_only))

    def _run(self) -> None:
        while True:
            try:  # bounded: a worker whose close() sentinel is lost still ends
                task = self._tasks.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                if self._closed:  # the queue is empty: nothing queued before close() is dropped
                    return
                continue
            try:
                if task is None:
                    return
                keys, phase, spare_only = task
                with self.cache.lock:  # one batch: the copies are issued back to back
                    for key in keys:
                        if not self.cache.prefetch(key, phase, spare_only) and key not in self.cache:
                            break  # no slot it may take: the rest would fail too
            except Exception:  # a failed copy surfaces to compute when it waits on the slot
                log.exception("Prefetch task failed")
            finally:
                self._tasks.task_done()

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Block until every submitted task has been issued; a worker that does not get there
        within `timeout_s` is an error, never a hang."""
        with self._tasks.all_tasks_done:
            if not self._tasks.all_tasks_done.wait_for(lambda: not self._tasks.unfinished_tasks, timeout_s):
                raise TimeoutError(f"The prefetch worker did not issue its tasks within {timeout_s:.0f} s.")

    def discard_pending(self) -> None:
        """Drop tasks not started yet (their step is over)."""
        while True:
            try:
                self._tasks.get_nowait()
            except queue.Empty:
                return
            self._tasks.task_done()

    def close(self) -> None:
        self.discard_pending()
        self._closed = True
        self._tasks.put(None)
        self._thread.join(timeout=5)


def route(router: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers router's top-k (indices, weights), each `[T, K]`, for hidden `[T, H]`."""
    outputs = [o for o in router(hidden) if isinstance(o, torch.Tensor)]
    logits = outputs[0]
    indices = next(o for o in outputs[1:] if not o.is_floating_point())
    weights = next((o for o in outputs[1:] if o.is_floating_point() and o.shape == indices.shape), None)
    if weights is None:
        weights = logits.float().softmax(-1).gather(-1, indices)
    return indices, weights


def routed_impact(router: nn.Module, hidden: torch.Tensor) -> dict[int, float]:
    """Each expert `router` picks for some token of `hidden [T, H]` → its routing weight summed
    over the tokens (its impact on the layer's output, as HybriMoE ranks prefetches)."""
    indices, weights = route(router, hidden)
    impact: dict[int, float] = defaultdict(float)
    for expert, weight in zip(indices.reshape(-1).tolist(), weights.reshape(-1).tolist(), strict=True):
        impact[expert] += weight
    return impact


class _Predictor:
    """Shared plumbing: the model's routers in MoE-layer order and the worker."""

    def __init__(self, model, worker: PrefetchWorker):
        self.model = model
        self.cache: ExpertCache = model.cache
        self.worker = worker
        blocks = moe_blocks(model.hf_model, model.arch)
        self.layers = sorted(blocks)  # target layer numbers of the MoE layers, in order
        self.routers = {layer: getattr(block, model.arch.router_attr) for layer, (_, block) in blocks.items()}

    def begin_step(self, verify_tokens: int = 1) -> None:
        """A new decode or speculative step starts; `verify_tokens`: the target forward's tokens."""

    def end_step(self) -> None:
        """The step is over: tasks not issued yet are stale."""
        self.worker.discard_pending()


class LayerAheadPredictor(_Predictor):
    """Next-layer (depth 1) and HybriMoE impact-driven (depth 3) prefetch, on any target forward."""

    def __init__(self, model, worker: PrefetchWorker, depth: int):
        super().__init__(model, worker)
        self.depth = depth

    def __call__(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        position = self.layers.index(layer)
        ranked: list[tuple[int, float, ExpertKey]] = []
        for distance, ahead in enumerate(self.layers[position + 1 : position + 1 + self.depth]):
            impact = routed_impact(self.routers[ahead], hidden)
            ranked += [(distance, -score, (ahead, expert)) for expert, score in impact.items()]
        keys = [key for *_, key in sorted(ranked) if key not in self.cache]
        self.worker.submit(keys, self.cache.phase)


class SpMoePredictor(_Predictor):
    """SP-MoE Alg. 1: during drafting, predict verification's experts for MoE layers up to the cutoff."""

    def __init__(self, model, worker: PrefetchWorker, cutoff: int, draft_model: nn.Module | None = None):
        super().__init__(model, worker)
        self.cutoff = cutoff  # position in MoE-layer order of the last layer prefetched; -1: none
        self._requested: set[ExpertKey] = set()
        self._submitted = 0  # keys handed to the worker this step
        self.spare_only = False  # the cache streams this step's verify: prefetch into spare slots only
        self._hooks = []
        if draft_model is not None:
            self._hook_draft_model(draft_model)

    def begin_step(self, verify_tokens: int = 1) -> None:
        self._requested.clear()
        self._submitted = 0
        self.spare_only = self.cache.streams(self.verify_experts(verify_tokens))

    @property
    def _done(self) -> bool:
        """Every spare slot has its prefetch: predicting more this step would buy nothing."""
        return self.spare_only and self._submitted >= STREAM_DEPTH

    def verify_experts(self, verify_tokens: int) -> int:
        """Expected distinct experts per layer of a verify over `verify_tokens` tokens (MoESD)."""
        store = self.cache.store
        return round(unique_experts(store.num_experts, self.model.top_k, verify_tokens))

    @property
    def prefetched_layers(self) -> list[int]:
        return self.layers[: self.cutoff + 1]

    def __call__(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """Observer on the target's layers: self and substitute drafts route with the target's routers."""
        if self.cache.phase == "draft" and layer in self.prefetched_layers and not self._done:
            self._request(layer, top_k_index.reshape(-1).tolist())

    def _request(self, layer: int, experts: list[int]) -> None:
        keys = [(layer, e) for e in dict.fromkeys(experts) if (layer, e) not in self._requested]
        self._requested.update(keys)
        missing = [k for k in keys if k not in self.cache]
        self._submitted += len(missing)
        self.worker.submit(missing, "draft", self.spare_only)

    def lookahead(self, layer: int, hidden: torch.Tensor) -> list[ExpertKey]:
        """During a streamed verify: the next MoE layer's experts routed from this layer's input
        (the next-layer gate), by routing weight summed over the tokens; the layer streams the
        first few while it finishes, so the link does not idle while the next layer's attention
        runs. (Ranked by weight, more of them were used on the demo than ranked by token count.)"""
        position = self.layers.index(layer)
        if position + 1 >= len(self.layers):
            return []
        ahead = self.layers[position + 1]
        impact = routed_impact(self.routers[ahead], hidden)
        return [(ahead, expert) for expert in sorted(impact, key=lambda e: -impact[e])]

    def _hook_draft_model(self, draft_model: nn.Module) -> None:
        """Route the draft's residual stream after attention through the target's norm and router."""
        draft_layers = decoder_of(draft_model).layers
        target_layers = decoder_of(self.model.hf_model).layers
        by_draft_layer: dict[int, list[int]] = defaultdict(list)
        for position, layer in enumerate(self.layers):
            # Same relative depth: the draft layer whose output is nearest to target layer `layer`'s.
            depth = (layer + 1) / len(target_layers)
            by_draft_layer[max(round(depth * len(draft_layers)) - 1, 0)].append((position, layer))
        for index, pairs in by_draft_layer.items():
            norm_hook = self._draft_layer_hook(pairs, target_layers)
            self._hooks.append(
                draft_layers[index].post_attention_layernorm.register_forward_pre_hook(norm_hook)
            )

    def _draft_layer_hook(self, pairs: list[tuple[int, int]], target_layers):
        def predict(_module, args):
            if self.cache.phase != "draft" or self._done:
                return
            # [1, 1, H] the draft's residual stream after attention at its newest position: the one
            # verification will process next (a catch-up forward's earlier positions are committed).
            residual = args[0][:, -1:]
            for position, layer in pairs:
                if position > self.cutoff:
                    continue
                norm = target_layers[layer].post_attention_layernorm
                hidden = norm(residual.to(norm.weight.dtype)).reshape(-1, residual.shape[-1])
                indices, _ = route(self.routers[layer], hidden)
                self._request(layer, indices.reshape(-1).tolist())

        return predict

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


@dataclass
class Prefetch:
    """The prefetch policy installed on a model for one run; `close()` uninstalls it."""

    policy: str
    description: str
    worker: PrefetchWorker | None = None
    predictor: _Predictor | None = None
    manual_cutoff: bool = False
    _load_ms: float | None = None
    _installed: ExitStack = field(default_factory=ExitStack)  # the model's control, restored on close

    def install(self, model, **changes) -> Prefetch:
        """Install `changes` on the model's `ExpertControl` until `close()`."""
        self._installed.enter_context(model.control.installed(**changes))
        return self

    def load_ms(self, model) -> float:
        """One expert's copy time: the simulated link's by construction, else measured once."""
        if self._load_ms is None:
            self._load_ms = measure_load_ms(model)
        return self._load_ms

    @property
    def cutoff_layer(self) -> int | None:
        """SP-MoE's current cutoff (a position in MoE-layer order); None for other policies."""
        return self.predictor.cutoff if isinstance(self.predictor, SpMoePredictor) else None

    def begin_step(self, verify_tokens: int = 1) -> None:
        if self.predictor is not None:
            self.predictor.begin_step(verify_tokens)

    def end_step(self) -> None:
        if self.predictor is not None:
            self.predictor.end_step()

    def close(self, model) -> None:
        self._installed.close()
        if isinstance(self.predictor, SpMoePredictor):
            self.predictor.close()
        if self.worker is not None:
            self.worker.close()
        model.cache.settle_prefetches()


def install_prefetch(
    model, policy: str, *, cutoff: int | None = None, speculative: bool = False, draft_model=None
) -> Prefetch:
    """Attach `policy`'s predictor to `model`; `cutoff` (SP-MoE) is a position in MoE-layer order."""
    if policy not in PREFETCH_POLICIES:
        raise InvalidRequestError(
            f"Unknown prefetch policy {policy!r}; choose one of {', '.join(PREFETCH_POLICIES)}."
        )
    if policy == "none":
        return Prefetch(policy, "none")
    if policy == "spmoe" and not speculative:
        raise InvalidRequestError(
            "--prefetch spmoe predicts from the draft: it needs --spec draft|self|substitute."
        )
    if policy == "spmoe" and draft_model is not None:
        draft_hidden, target_hidden = draft_model.config.hidden_size, model.hf_config.hidden_size
        if draft_hidden != target_hidden:
            log.warning(
                "SP-MoE prefetch needs the draft's hidden size (%d) to match the target's (%d); "
                "falling back to next-layer prefetch.",
                draft_hidden,
                target_hidden,
            )
            fallback = install_prefetch(model, "next-layer")
            fallback.description = (
                f"next-layer (spmoe fallback: draft hidden {draft_hidden} != {target_hidden})"
            )
            return fallback
    worker = PrefetchWorker(model.cache)
    if policy == "spmoe":
        layers = len(moe_blocks(model.hf_model, model.arch))
        manual = cutoff is not None
        if manual and not -1 <= cutoff < layers:
            worker.close()
            raise InvalidRequestError(
                f"--cutoff must be from -1 (no prefetch) to {layers - 1}, got {cutoff}."
            )
        cutoff = layers - 1 if cutoff is None else cutoff  # auto: refined after the first measured draft
        predictor: _Predictor = SpMoePredictor(model, worker, cutoff, draft_model)
        description = f"spmoe (cutoff {cutoff} of {layers} MoE layers{'' if manual else ', auto'})"
        prefetch = Prefetch(policy, description, worker, predictor, manual_cutoff=manual)
        return prefetch.install(
            model, observers=(*model.control.observers, predictor), lookahead=predictor.lookahead
        )
    depth = 1 if policy == "next-layer" else HYBRIMOE_DEPTH
    predictor = LayerAheadPredictor(model, worker, depth)
    return Prefetch(policy, policy, worker, predictor).install(
        model, observers=(*model.control.observers, predictor)
    )


def measure_load_ms(model) -> float:
    """Milliseconds to copy one expert host → device over this model's link."""
    link, nbytes = model.transfer, model.store.expert_nbytes
    if link.simulated:
        if link.gbps is None:
            return 0.0
        return link.latency_s * 1e3 + nbytes / (link.gbps * 1e9) * 1e3
    src = model.store.buffer(model.store.layer_indices[0], 0)
    dst = torch.empty_like(src, device=model.device)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize(model.device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(model.device)
    return (time.perf_counter() - start) * 1e3 / 5
