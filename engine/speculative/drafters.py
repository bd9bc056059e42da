"""Drafters: cheap proposals of the next few tokens, behind one interface.

- `ModelDrafter` (`draft`): a separate small model sharing the tokenizer, fully
  resident on the device, with its own KV cache (SP-MoE's setting).
- `SelfDrafter` (`self`): the target itself, each token routed to its top-r
  experts (r < k), SS-MoE; optionally only experts already cached (zero I/O).
- `SubstituteDrafter` (`substitute`): the target with low-bit copies of every
  routed expert resident on the device (SubSpec); no cache use, no I/O.

Self and substitute drafts run the target's own layers and share its KV cache:
they append their (approximate) entries while drafting and `propose` crops
them off again, so verification recomputes those positions exactly.

Contract of `propose(history, n, target_kv_cache)`: `history [L]` is every
committed token, the last of which has not been fed to the target yet (its KV
cache, `target_kv_cache`, holds L−1 positions). It returns up to `n` tokens
and, when sampling, the distributions they were drawn from (needed by
rejection sampling). `rewind(committed)` tells the drafter that the first
`committed` tokens of the history are final.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from engine.errors import DeviceOutOfMemoryError, InvalidRequestError, ModelNotFoundError
from engine.model.hf_calls import with_cache
from engine.model.kv_cache import RecurrentState, new_kv_cache, rewind_cache
from engine.moe.control import DraftRouting
from engine.sampling import Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None  # [n, V] the distributions the tokens were drawn from (None: greedy)
    confident: int  # leading tokens drafted with confidence >= tau (all of them when tau is off)


class Drafter(ABC):
    name: str
    resident_nbytes: int = 0  # device memory the drafter adds (draft weights, substitutes)

    def __init__(self, sampler: Sampler, confidence_tau: float = 0.0):
        self.sampler = sampler
        self.confidence_tau = confidence_tau

    @abstractmethod
    def propose(self, history: torch.Tensor, n: int, target_kv_cache: DynamicCache) -> Draft:
        """Up to `n` draft tokens following `history` (the target's KV cache holds all but its last
        token). A self-drafter drafts in `target_kv_cache` itself and leaves its approximate
        entries there: the decoder drops them before verifying (`SpeculativeDecoder._draft`)."""

    def rewind(self, kept: int) -> None:  # noqa: B027 - drafters with no state of their own
        """The first `kept` tokens of the new history are final (all of it but its last token, as
        in the target's KV cache after the step); forget anything drafted past them."""

    def close(self) -> None:  # noqa: B027
        """Release what the drafter holds."""

    def _draw(self, logits_fn, history: torch.Tensor, n: int) -> Draft:
        """The draft loop: `logits_fn(ids)` feeds ids and returns the next position's logits."""
        logits = logits_fn(None)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        sampling = not self.sampler.config.is_greedy
        confident = n
        context = history
        for i in range(n):
            if sampling:
                dist = self.sampler.probs(logits, context)  # [V]
                token = int(torch.multinomial(dist, 1, generator=self.sampler.generator))
                probs.append(dist)
            else:
                token = self.sampler.sample(logits, context)
            tokens.append(token)
            context = torch.cat([context, context.new_tensor([token])])
            if self.confidence_tau and _confidence(logits, dist if sampling else None) < self.confidence_tau:
                confident = i  # SS-MoE: a low-confidence token ends the draft (it is kept)
                break
            if i + 1 < n:
                logits = logits_fn(token)
        return Draft(tokens, torch.stack(probs) if sampling else None, confident)


def _confidence(logits: torch.Tensor, dist: torch.Tensor | None) -> float:
    """The draft's max probability (of its raw softmax when greedy: the greedy one-hot says nothing)."""
    return float((dist if dist is not None else logits.float().softmax(-1)).max())


class ModelDrafter(Drafter):
    """A separate small causal LM, resident on the device, with its own KV cache."""

    name = "draft"

    def __init__(self, target, folder: str | Path, sampler: Sampler, confidence_tau: float = 0.0):
        super().__init__(sampler, confidence_tau)
        self.model = load_draft_model(folder, target)
        self.kv_cache = new_kv_cache(self.model.config, rewindable=True)
        self.saved: RecurrentState | None = None  # a recurrent draft's state where `propose` began
        self.device = target.device
        self.resident_nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def propose(self, history: torch.Tensor, n: int, target_kv_cache: DynamicCache) -> Draft:
        fed = self.kv_cache.get_seq_length()
        pending = history[fed:]  # catch up on committed tokens the draft has not seen
        self.saved = RecurrentState.save(self.kv_cache)

        def logits_fn(token: int | None) -> torch.Tensor:
            ids = pending if token is None else pending.new_tensor([token])
            inputs = ids.view(1, -1).to(self.device)
            out = self.model(input_ids=inputs, **with_cache(self.model, self.kv_cache, use_cache=True))
            return out.logits[0, -1]

        try:
            return self._draw(logits_fn, history, n)
        except torch.OutOfMemoryError as err:
            raise DeviceOutOfMemoryError("Out of device memory running the draft model.") from err

    def rewind(self, kept: int) -> None:
        """A recurrent draft goes back to where its proposal began and feeds the kept tokens
        again with the next one (its state cannot be cropped to `kept`)."""
        if self.saved is not None and self.kv_cache.get_seq_length() > kept:
            rewind_cache(self.kv_cache, self.saved.length, self.saved)
        else:
            rewind_cache(self.kv_cache, kept)

    def close(self) -> None:
        self.kv_cache = new_kv_cache(self.model.config, rewindable=True)
        self.saved = None


def load_draft_model(folder: str | Path, target) -> torch.nn.Module:
    """The draft causal LM from `folder`, on the target's device and dtype; its vocabulary must match."""
    path = Path(folder).expanduser().resolve()
    if path not in target.draft_models:
        target.draft_models[path] = _read_draft_model(path, target)
    return target.draft_models[path]


def _read_draft_model(path: Path, target) -> torch.nn.Module:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"No draft model at {path} (no config.json). Give --draft-model a model folder."
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device).eval()
    except torch.OutOfMemoryError as err:
        raise DeviceOutOfMemoryError(f"Out of device memory loading the draft model {path}.") from err
    except (OSError, ValueError, KeyError) as err:
        raise InvalidRequestError(f"Cannot load the draft model {path}: {err}") from err
    if model.config.vocab_size != target.hf_config.vocab_size:
        raise InvalidRequestError(
            f"The draft model's vocabulary ({model.config.vocab_size} tokens) differs from the target's "
            f"({target.hf_config.vocab_size}): a draft must share the target's tokenizer."
        )
    return model


class _TargetDrafter(Drafter):
    """Drafts with the target's own layers under a `DraftRouting`, in its KV cache."""

    def __init__(self, target, routing: DraftRouting, sampler: Sampler, confidence_tau: float = 0.0):
        super().__init__(sampler, confidence_tau)
        self.target = target
        self.routing = routing

    def propose(self, history: torch.Tensor, n: int, target_kv_cache: DynamicCache) -> Draft:
        start = target_kv_cache.get_seq_length()

        def logits_fn(token: int | None) -> torch.Tensor:
            ids = history[start:] if token is None else history.new_tensor([token])
            return self.target.forward(ids, target_kv_cache)[-1]

        with self.target.control.installed(draft=self.routing):
            return self._draw(logits_fn, history, n)


class SelfDrafter(_TargetDrafter):
    name = "self"

    def __init__(self, target, sampler: Sampler, top_r: int, cached_only: bool, confidence_tau: float = 0.0):
        if not 1 <= top_r < target.top_k:
            raise InvalidRequestError(
                f"--top-r must be at least 1 and below the model's {target.top_k} experts per token, "
                f"got {top_r}."
            )
        super().__init__(target, DraftRouting(top_r=top_r, cached_only=cached_only), sampler, confidence_tau)


class SubstituteDrafter(_TargetDrafter):
    name = "substitute"

    def __init__(self, target, substitutes, sampler: Sampler, confidence_tau: float = 0.0):
        super().__init__(target, DraftRouting(substitute=substitutes), sampler, confidence_tau)
        self.resident_nbytes = substitutes.nbytes
