"""`OffloadedModel`: a loaded model whose routed experts are served by the expert cache.

It wraps transformers' causal-LM module (built without its routed experts) and
owns the expert store, the cache, the transfer engine, the routing trace and the
ordered list of decode-step paths (engine.decode.paths). `forward` runs one chunk
of tokens against a KV cache and `decode` one token id, each on the first path that
takes it, and returns the logits of the positions asked for.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from engine.config import OffloadConfig
from engine.decode import whole_step
from engine.decode.captured_step import CapturedStep
from engine.decode.lean import LeanDecode
from engine.decode.paths import Step, StepPaths
from engine.decode.piecewise_step import PiecewiseStep
from engine.device_cache.eviction import make_policy
from engine.device_cache.expert_cache import ExpertCache
from engine.device_cache.transfer import TransferEngine
from engine.errors import DeviceOutOfMemoryError, InvalidRequestError
from engine.model.adapters.base import Architecture
from engine.model.kv_cache import new_kv_cache
from engine.model.prefix_cache import PrefixCache
from engine.moe.control import ExpertControl
from engine.moe.layer import OffloadedExperts
from engine.moe.routing_trace import RoutingTrace
from engine.store.host_store import ExpertStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What a user (and the GUI) wants to know about a loaded model."""

    path: str
    model_type: str
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    expert_nbytes: int
    cache_slots: int
    dtype: str
    device: str
    disk_layout: str
    simulated_link: bool
    resident_nbytes: int
    store_nbytes: int
    expert_dtype: str = "native"  # native | int8 | int4: the routed experts' precision in the store
    context_length: int | None = None  # tokens (prompt + reply) the model was built for; None: unknown
    context_limit: int | None = None  # the context length it was loaded with (None: its own)
    experts_in_place: bool = False  # CPU, no link simulated: the experts are used where the store holds them
    kernels: str = "exact"  # what computes the model on the CPU: exact (torch) or ggml (llama.cpp's)


class OffloadedModel:
    def __init__(
        self,
        *,
        path: Path,
        hf_model: torch.nn.Module,
        tokenizer,
        arch: Architecture,
        config: OffloadConfig,
        device: torch.device,
        dtype: torch.dtype,
        store: ExpertStore,
        cache: ExpertCache,
        transfer: TransferEngine,
        trace: RoutingTrace,
        control: ExpertControl,
        top_k: int,
        disk_layout: str,
    ):
        self.path = path
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.arch = arch
        self.config = config
        self.device = device
        self.dtype = dtype
        self.store = store
        self.cache = cache
        self.transfer = transfer
        self.trace = trace
        self.top_k = top_k
        self.disk_layout = disk_layout
        self.control = control  # the one every MoE layer shares: what a run installs on them
        self.draft_models: dict[Path, torch.nn.Module] = {}  # loaded once, reused by every run
        # engine.speculative's draft-length controller per speculation setting: the acceptance
        # learnt so far carries over to the next reply (this layer only keeps them)
        self.draft_lengths: dict[tuple, object] = {}
        # the KV caches of the latest replies: a new turn prefills only what they do not hold
        self.prefix_cache = PrefixCache()
        self._substitutes: dict[int, ExpertStore] = {}
        self.experts: dict[int, OffloadedExperts] = {}
        for module in hf_model.modules():
            if isinstance(module, OffloadedExperts):
                self.experts[module.layer] = module
        self.lean = LeanDecode.of(hf_model)  # decode steps without transformers' wrappers, or None
        # with ggml's kernels, its layers' ends and head as ggml graphs, and a step in one graph
        whole = whole_step.attach(self.lean) if config.kernels == "ggml" else None
        # on CUDA, a one-token step over a cache holding every expert as one CUDA graph
        self.captured = CapturedStep.of(self)
        # ... and over a cache that can miss, as graph pieces with the experts brought in between
        self.pieces = PiecewiseStep.of(self, self.captured)
        # where a step's path is chosen
        self.paths = StepPaths.of(hf_model, self.lean, whole, self.captured, self.pieces)
        log.debug("Decode-step paths: %s", ", ".join(self.paths.names))

    @property
    def hf_config(self):
        return self.hf_model.config

    @property
    def simulated_link(self) -> bool:
        """Whether copies cross a simulated link (never when the experts are used in place)."""
        return self.transfer.simulated and not self.cache.in_place

    @property
    def context_length(self) -> int | None:
        """The model's context window in tokens (the config's max_position_embeddings); None when
        the config does not say."""
        length = getattr(self.hf_config, "max_position_embeddings", None)
        return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None

    def info(self) -> ModelInfo:
        tensors = itertools.chain(self.hf_model.parameters(), self.hf_model.buffers())
        resident = sum(t.numel() * t.element_size() for t in tensors)  # a GGUF's embedding blocks too
        return ModelInfo(
            path=str(self.path),
            model_type=self.arch.model_type,
            num_layers=self.hf_config.num_hidden_layers,
            moe_layers=len(self.store.layer_indices),
            num_experts=self.store.num_experts,
            top_k=self.top_k,
            expert_nbytes=self.store.expert_nbytes,
            cache_slots=self.cache.n_slots,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            disk_layout=self.disk_layout,
            simulated_link=self.simulated_link,
            resident_nbytes=resident,
            store_nbytes=self.store.nbytes,
            expert_dtype=self._expert_dtype(),
            context_length=self.context_length,
            context_limit=self.config.context_length,
            experts_in_place=self.cache.in_place,
            kernels=self.config.kernels,
        )

    def _expert_dtype(self) -> str:
        """How the store holds the experts: native, int8, int4, fp8, int4 (gptq) or a GGUF file's types."""
        return self.store.layout.format_name

    def use_cache_policy(self, policy: str) -> None:
        """The expert cache under the eviction policy `policy` ("lru", "lfu", "mrs"); changing it
        empties the cache (as a fresh load starts), so the policy in place is left as it is."""
        if policy != self.cache.policy.name:
            self.cache.use_policy(make_policy(policy, top_k=self.top_k, alpha=self.config.mrs_alpha))

    def substitutes(self, bits: int) -> ExpertStore:
        """SubSpec's low-bit copies of every routed expert, resident on the device (built once)."""
        if bits not in self._substitutes:
            from engine.formats.int_quant import QuantSpec
            from engine.store.host_store import quantize_store

            spec, stored = QuantSpec(bits), self.store.layout.quant
            if self._expert_dtype() not in ("native", "int4", "int8"):
                raise InvalidRequestError(
                    f"--spec substitute makes int{bits} copies of full-precision experts; this model's "
                    f"experts are {self._expert_dtype()} already. Use --spec self or draft."
                )
            if stored is not None and stored != spec:
                raise InvalidRequestError(
                    f"int{bits} substitutes need the experts at full precision or int{bits}, but this "
                    f"model was loaded with {stored.name} experts. Reload with --expert-dtype native."
                )
            try:
                if stored == spec:  # the store already is the low-bit copy: put it on the device
                    self._substitutes[bits] = self.store.to(self.device)
                else:
                    self._substitutes[bits] = quantize_store(self.store, spec, device=self.device)
            except torch.OutOfMemoryError as err:
                raise DeviceOutOfMemoryError(
                    f"Out of device memory for the int{bits} substitute experts "
                    f"({self.store.total_experts} experts). Lower --expert-budget or use another --spec."
                ) from err
        return self._substitutes[bits]

    def drafter_nbytes(self) -> int:
        """Device memory held by loaded draft models and substitute experts."""
        drafts = sum(p.numel() * p.element_size() for m in self.draft_models.values() for p in m.parameters())
        return drafts + sum(store.nbytes for store in self._substitutes.values())

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The KV cache's storage dtype when --kv-dtype sets one apart from the compute dtype."""
        name = self.config.kv_dtype
        return None if name == "auto" or getattr(torch, name) == self.dtype else getattr(torch, name)

    def new_kv_cache(self, rewindable: bool = False) -> DynamicCache:
        """The model's own KV cache (linear-attention and Mamba state included); `rewindable` keeps
        every position of sliding-window layers so speculative decoding can crop rejected drafts;
        keys and values in --kv-dtype. Where the decode step is a CUDA graph through the model's
        own modules, sliding-window layers keep every position too (the graph masks the window)."""
        whole = rewindable or (self.captured is not None and self.captured.needs_every_position)
        return new_kv_cache(self.hf_config, whole, self.kv_dtype)

    def decode(self, token: int, kv_cache: DynamicCache) -> torch.Tensor:
        """The logits `[V]` of one token id after `kv_cache`'s positions: `forward`'s of `[token]`,
        valid until the next `decode` (read them before it). The id goes to the step's path as it
        is: the ggml graph paths take it outside inference mode (they run no torch operator
        autograd would record) and write the logits into the same buffer each step."""
        return self._run(Step(kv_cache, 1, token=token, device=self.device))

    def forward(
        self, input_ids: torch.Tensor, kv_cache: DynamicCache, logits_to_keep: int = 1
    ) -> torch.Tensor:
        """Logits `[n, V]` of the last `logits_to_keep` positions of `input_ids [T]` (0 keeps all)."""
        return self._run(Step(kv_cache, logits_to_keep, tokens=input_ids.view(1, -1).to(self.device)))

    def _run(self, step: Step) -> torch.Tensor:
        """`step` on the first of the model's paths that takes it (engine.decode.paths)."""
        try:
            return self.paths.run(step)
        except torch.OutOfMemoryError as err:
            self.cache.clear()
            raise DeviceOutOfMemoryError(
                "Out of device memory while running the model. Lower --expert-budget or the context length."
            ) from err

    def close(self) -> None:
        self.prefix_cache.close()
        self.transfer.close()
