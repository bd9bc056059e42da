"""`OffloadedModel`: a loaded model whose routed experts are served by the expert cache.

It wraps transformers' causal-LM module (built without its routed experts) and
owns the expert store, the cache, the transfer engine and the routing trace.
`forward` runs one chunk of tokens against a KV cache and returns the logits
of the positions asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from engine.config import OffloadConfig
from engine.errors import DeviceOutOfMemoryError
from engine.expert_cache import ExpertCache
from engine.expert_store import ExpertStore
from engine.models.base import Architecture
from engine.moe_layer import RoutingTrace
from engine.transfer import TransferEngine

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

    @property
    def hf_config(self):
        return self.hf_model.config

    @property
    def simulated_link(self) -> bool:
        return self.transfer.simulated

    def info(self) -> ModelInfo:
        resident = sum(p.numel() * p.element_size() for p in self.hf_model.parameters())
        return ModelInfo(
            path=str(self.path),
            model_type=self.arch.model_type,
            num_layers=self.hf_config.num_hidden_layers,
            moe_layers=len(self.store.layer_indices),
            num_experts=self.store.num_experts,
            top_k=self.top_k,
            expert_nbytes=self.store.layout.nbytes,
            cache_slots=self.cache.n_slots,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            disk_layout=self.disk_layout,
            simulated_link=self.simulated_link,
            resident_nbytes=resident,
            store_nbytes=self.store.nbytes,
        )

    def new_kv_cache(self) -> DynamicCache:
        return DynamicCache(config=self.hf_config)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, kv_cache: DynamicCache, logits_to_keep: int = 1
    ) -> torch.Tensor:
        """Logits `[n, V]` of the last `logits_to_keep` positions of `input_ids [T]` (0 keeps all)."""
        try:
            output = self.hf_model(
                input_ids=input_ids.view(1, -1).to(self.device),
                past_key_values=kv_cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        except torch.OutOfMemoryError as err:
            self.cache.clear()
            raise DeviceOutOfMemoryError(
                "Out of device memory while running the model. Lower --expert-budget or the context length."
            ) from err
        return output.logits[0]

    def close(self) -> None:
        self.transfer.close()
