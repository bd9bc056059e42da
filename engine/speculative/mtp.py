"""`MtpDrafter` (`--spec mtp`): drafts with the checkpoint's own multi-token-prediction layer.

The MTP layer (engine.model.mtp_layer) predicts token t+2 from the target's last hidden state at t and
the embedding of token t+1. The drafter keeps an MTP KV cache whose entry j is that step for target
position `base + j`, fed with the target's own hidden states: `TargetHiddenStates` records them
from every target forward (a forward hook on its decoder), so prefill and each verification hand
them over without another forward. A proposal

    catch up   feeds the MTP every committed position it has not seen (the accepted tokens of the
               last verify, or the whole prompt after prefill); the last one's logits give d1
    chain      feeds its own output hidden state with d_i to get d_{i+1} (vLLM's MTP proposer)

and `rewind` drops the chained entries: they were made from the MTP's hidden states, not the
target's, so the next proposal recomputes those positions from verification's. When a reply ends
its MTP cache is kept with the head (`MtpHead.kept`), and the next reply reuses the entries of the
tokens it shares with it, as the target reuses its prefix cache: a prompt prefix the target does
not run again is not lost to the draft (a seeded reply stays the same). A position the target
never showed the drafter otherwise starts the MTP cache afresh from the first one it did show: the
draft sees less context, the output is the same.

The MTP head is read once per loaded model (kept in its `draft_models`, counted in
`drafter_nbytes`) from the safetensors folder the model came from; GGUF files and pre-quantized
checkpoints are refused with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from engine.errors import DeviceOutOfMemoryError, EngineError, InvalidRequestError, MissingTensorsError
from engine.formats.native_experts import find_layout, read_expert
from engine.model.adapters.generic import is_routed_experts
from engine.model.checkpoint import Checkpoint
from engine.model.folder import open_checkpoint
from engine.model.hf_calls import decoder_of
from engine.model.kv_cache import rewind_cache
from engine.model.mtp_layer import MtpFormat, MtpHead, build_mtp_head, find_mtp, require_mtp
from engine.sampling import Sampler
from engine.speculative.drafters import Draft, Drafter

log = logging.getLogger(__name__)

MTP_KEY = "mtp"  # the head's key in the model's `draft_models`
CATCH_UP_CHUNK = 512  # positions per MTP forward when catching up on a long prompt


@dataclass(frozen=True)
class KeptMtpCache:
    """A finished reply's MTP cache: entry j is target position `base + j`, made from `tokens`."""

    kv_cache: DynamicCache
    base: int
    tokens: torch.Tensor  # [base + entries + 1] the tokens its entries were made from

    def reusable(self, history: torch.Tensor, committed: int) -> int:
        """Entries still right for `history`: those whose tokens it shares, short of `committed`."""
        shared = int((self.tokens[: len(history)] == history[: len(self.tokens)]).cumprod(0).sum())
        return max(min(self.kv_cache.get_seq_length(), shared - 1 - self.base, committed - 1 - self.base), 0)


class TargetHiddenStates:
    """The target's last hidden state (after its final norm) per position, recorded from every
    forward of its decoder; positions are read from the KV cache the forward was given."""

    def __init__(self, decoder: nn.Module):
        self.start = 0  # position of rows[0]
        self.rows: torch.Tensor | None = None  # [P, H]
        self._hook = decoder.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, _module, _args, kwargs, output) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None:
            raise RuntimeError("the target's decoder ran without a KV cache: its positions are unknown")
        hidden = output[0][0].detach()  # [T, H] (last_hidden_state of the one sequence)
        start = cache.get_seq_length() - hidden.shape[0]
        if self.rows is not None and self.start <= start <= self.end:  # a later forward overwrites
            self.rows = torch.cat([self.rows[: start - self.start], hidden])
        else:
            self.start, self.rows = start, hidden

    @property
    def end(self) -> int:
        return self.start + (0 if self.rows is None else len(self.rows))

    def between(self, first: int, end: int) -> torch.Tensor:
        """Rows of positions `first … end-1` (all recorded)."""
        return self.rows[first - self.start : end - self.start]

    def forget_before(self, position: int) -> None:
        if self.rows is not None and position > self.start:
            self.rows = self.rows[position - self.start :]
            self.start = position

    def close(self) -> None:
        self._hook.remove()
        self.rows = None


class MtpDrafter(Drafter):
    """Drafts with the checkpoint's MTP layer from the target's hidden states (see the module)."""

    name = "mtp"

    def __init__(self, target, sampler: Sampler, confidence_tau: float = 0.0):
        super().__init__(sampler, confidence_tau)
        self.model = mtp_head(target)  # `model`: SP-MoE hooks its decoder layer like a draft model's
        self.embed = target.hf_model.get_input_embeddings()
        self.lm_head = target.hf_model.get_output_embeddings()
        self.rotary = decoder_of(target.hf_model).rotary_emb
        self.resident_nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.hidden = TargetHiddenStates(decoder_of(target.hf_model))
        self.kv_cache: DynamicCache = self.model.new_cache()
        self.base = 0  # target position of the MTP cache's first entry
        self.exact = 0  # MTP cache entries made from the target's hidden states (the rest are drafts)
        self.kept, self.model.kept = self.model.kept, None  # the previous reply's, until the first draft
        self.tokens: torch.Tensor | None = None  # the latest history proposed from

    @torch.inference_mode()
    def propose(self, history: torch.Tensor, n: int, target_kv_cache: DynamicCache) -> Draft:
        committed = target_kv_cache.get_seq_length()  # the target's hidden states exist up to here
        self.tokens = history
        self._reuse_kept(history, committed)
        first = self._first_position(committed)
        if first is None:
            log.warning(
                "MTP draft skipped: the target's hidden state at position %d was not seen", committed - 1
            )
            return Draft([], None, 0)
        chained: list[torch.Tensor] = []

        def logits_fn(token: int | None) -> torch.Tensor:
            if token is None:
                out, normed = self._catch_up(history, first, committed)
            else:
                ids = history.new_tensor([token]).to(self.embed.weight.device)
                out, normed = self.model(self.embed(ids), chained[-1], self.kv_cache, self.rotary)
            chained.append(out[-1:])  # [1, H]: fed back with the token drafted from it
            return self.lm_head(normed[-1])  # [V]

        try:
            return self._draw(logits_fn, history, n)
        except torch.OutOfMemoryError as err:
            raise DeviceOutOfMemoryError("Out of device memory running the MTP layer.") from err

    def _reuse_kept(self, history: torch.Tensor, committed: int) -> None:
        """Start from the previous reply's MTP cache where it holds this history's tokens."""
        kept, self.kept = self.kept, None
        if kept is None or (reused := kept.reusable(history, committed)) < 1:
            return
        rewind_cache(kept.kv_cache, reused)
        self.kv_cache, self.base, self.exact = kept.kv_cache, kept.base, reused

    def _first_position(self, committed: int) -> int | None:
        """The first committed position to feed the MTP; None when the last one's hidden state is
        missing. The cache starts afresh where the recorded positions do not follow on from it."""
        first = self.base + self.exact
        if self.hidden.end < committed:
            return None
        if not self.hidden.start <= first < committed:
            self.kv_cache = self.model.new_cache()
            self.base = first = self.hidden.start
            self.exact = 0
        return first

    def _catch_up(self, history: torch.Tensor, first: int, committed: int):
        """Feed positions `first … committed-1` (hidden state at p, token p+1); the last one's output."""
        for start in range(first, committed, CATCH_UP_CHUNK):
            end = min(start + CATCH_UP_CHUNK, committed)
            ids = history[start + 1 : end + 1].to(self.embed.weight.device)
            hidden = self.hidden.between(start, end).to(self.embed.weight.dtype)  # [k, H]
            out = self.model(self.embed(ids), hidden, self.kv_cache, self.rotary)
        self.exact = self.kv_cache.get_seq_length()
        self.hidden.forget_before(committed)
        return out

    def rewind(self, kept: int) -> None:
        """Only entries made from the target's hidden states stay (`kept` is ahead of them)."""
        rewind_cache(self.kv_cache, self.exact)

    def close(self) -> None:
        """Keep the entries made from the target's states with the head, for the next reply."""
        self.hidden.close()
        rewind_cache(self.kv_cache, self.exact)
        if self.tokens is not None and self.exact > 0:
            tokens = self.tokens[: self.base + self.exact + 1]
            self.model.kept = KeptMtpCache(self.kv_cache, self.base, tokens)
        elif self.kept is not None:  # no draft this reply: the previous one's stays
            self.model.kept = self.kept
        self.kv_cache = self.model.new_cache()


def has_mtp_layer(model) -> bool:
    """Whether `model`'s checkpoint carries an MTP layer `--spec mtp` can read."""
    if MTP_KEY in model.draft_models:
        return True
    text = model.hf_config.get_text_config()
    counted = getattr(text, "num_nextn_predict_layers", 0) or getattr(text, "mtp_num_hidden_layers", 0)
    if not counted or getattr(model.hf_config, "quantization_config", None):
        return False
    try:
        with Checkpoint(model.path) as checkpoint:  # names only: nothing is read
            return find_mtp(model.hf_config, checkpoint) is not None
    except EngineError:  # a GGUF file, or no safetensors: no MTP layer to read
        return False


def mtp_head(target) -> MtpHead:
    """The target checkpoint's MTP head on its device, read on first use and kept with the model."""
    if MTP_KEY not in target.draft_models:
        target.draft_models[MTP_KEY] = _read_mtp_head(target)
    return target.draft_models[MTP_KEY]


def _read_mtp_head(target) -> MtpHead:
    hf_config, checkpoint = open_checkpoint(Path(target.path))
    try:
        if not isinstance(checkpoint, Checkpoint):
            raise InvalidRequestError(
                f"--spec mtp reads the MTP layer from a safetensors checkpoint; {target.path} is a GGUF "
                "file. Use the model's safetensors release, or --spec self."
            )
        if getattr(hf_config, "quantization_config", None):
            raise InvalidRequestError(
                "--spec mtp reads BF16/FP16/FP32 MTP layers; this checkpoint is pre-quantized. "
                "Use the model's BF16 release, or --spec self."
            )
        mtp = require_mtp(target.hf_config, checkpoint, str(target.path))
        if mtp.layers > 1:
            log.info("The checkpoint has %d MTP layers; the first drafts every token.", mtp.layers)
        try:
            head = load_mtp_head(
                target.hf_model, checkpoint, mtp, target.arch.layouts, target.dtype, target.device
            )
        except torch.OutOfMemoryError as err:
            raise DeviceOutOfMemoryError(
                "Out of device memory for the MTP layer. Use another --spec."
            ) from err
    finally:
        checkpoint.close()
    log.info("MTP layer read (%s format): %.1f MiB resident", mtp.name, _nbytes(head) / 2**20)
    return head


def _nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def load_mtp_head(hf_model, checkpoint: Checkpoint, mtp: MtpFormat, layouts, dtype, device) -> MtpHead:
    """The MTP head with every weight read from `checkpoint` onto `device`, its experts resident in
    transformers' experts module (read through the family's expert disk layouts)."""
    head = build_mtp_head(hf_model, mtp, dtype)
    head.to_empty(device=device)
    layer = head.layers[0]
    experts_path, experts = next((n, m) for n, m in layer.named_modules() if is_routed_experts(m))
    persistent = layer.state_dict(keep_vars=True)
    if set(dict(layer.named_buffers())) - set(persistent):
        raise InvalidRequestError(
            "This model's MTP decoder layer has state no checkpoint holds; use another --spec."
        )
    for name, target in persistent.items():
        if not name.startswith(f"{experts_path}."):
            _copy(target, _read(checkpoint, mtp.layer_prefix + name, target.dtype), name)
    for part, stored in mtp.parts.items():
        weight = getattr(head, part).weight
        _copy(weight, _read(checkpoint, f"{stored}.weight", weight.dtype), stored)
    disk_layout = find_layout(checkpoint, layouts, mtp.layer_prefix)
    fields = dict(experts.named_parameters())
    for expert in range(experts.num_experts):
        for field, value in read_expert(checkpoint, disk_layout, mtp.layer_prefix, expert, dtype).items():
            _copy(fields[field][expert], value, f"{mtp.layer_prefix}{experts_path} {expert} {field}")
    return head.eval()


def _read(checkpoint: Checkpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    if name not in checkpoint:
        raise MissingTensorsError(
            f"The checkpoint's MTP layer lacks {name}: it is incomplete. Download it again or use "
            "another --spec."
        )
    return checkpoint.read(name, dtype)


def _copy(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise MissingTensorsError(
            f"MTP weight {name} has shape {tuple(value.shape)} but the model expects {tuple(target.shape)}: "
            "the config and the MTP weights disagree."
        )
    with torch.no_grad():
        target.copy_(value)
