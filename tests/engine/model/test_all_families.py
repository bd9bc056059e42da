"""Every Mixture-of-Experts family transformers ships, exact through the engine (issue 20).

Generated from transformers' registry (engine.tiny.registry.moe_model_types): for each
family a tiny random model from its own config class (shrunk generically), saved as transformers
saves it (a vision-language family as its published vision-language class, whose language model
transformers' causal-LM class reads back as the reference), loaded by the engine with a quarter
of its routed experts cached on a simulated link. The engine's logits equal transformers' (fp32,
1e-4), 32 greedy tokens are transformers' own, and greedy self-speculation gives plain greedy's
tokens, as does greedy MTP speculation where the family publishes MTP layers (`MTP_FAMILIES`).
Families the adapter refuses are listed in engine.model.adapters.families.NOT_SUPPORTED with the
reason; families exact in plain decoding whose speculation is not yet are in SPEC_XFAIL
below with the reason. The count of exact families is printed at the end of the run
(tests/engine/model/conftest.py).
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import InvalidRequestError
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.loader import load_model
from engine.model.adapters import NOT_SUPPORTED, SUPPORTED_MODEL_TYPES
from engine.model.adapters.families import NO_SPECULATION
from engine.model.hf_calls import with_cache
from engine.tiny.models import published_tiny_model, save_tiny_model
from engine.tiny.registry import is_multimodal, moe_model_types
from tests.engine.exactness import assert_matches_reference
from tests.engine.speculative.mtp_checkpoints import save_with_mtp
from tests.engine.standard_families import STANDARD_FAMILIES

# Families whose published checkpoints carry multi-token-prediction layers in a format the engine
# reads (engine.model.mtp_layer: DeepSeek's nextn, Qwen's mtp.*): `--spec mtp` is checked on each, with
# the MTP layer saved as those checkpoints have it (tests/engine/speculative/mtp_checkpoints.py).
# MiMo-V2-Flash, Mellum, MiniMax-M2, EXAONE-MoE, Hunyuan-V3, Nemotron-H and Inkling publish theirs
# in other layouts, which are not read (`--spec mtp` says so; `self` drafts instead).
MTP_FAMILIES = (
    "deepseek_v3",
    "deepseek_v32",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "qwen3_5_moe",
    "qwen3_next",
    "sarvam_mla",
)

# Exact in plain decoding, not yet in speculative decoding: family -> why (none today: the
# engine's cache is the model's own, and recurrent state goes back by a saved copy).
SPEC_XFAIL: dict[str, str] = {}

# Families whose one-token steps go through engine.decode.lean (the others: transformers' forward)
LEAN_FAMILIES = STANDARD_FAMILIES

PROMPT_LENGTH, NEW_TOKENS = 12, 32
EAGER = {"dtype": torch.float32, "attn_implementation": "eager", "experts_implementation": "eager"}


def _params(families):
    return [
        pytest.param(f, marks=pytest.mark.skip(reason=NOT_SUPPORTED[f])) if f in NOT_SUPPORTED else f
        for f in families
    ]


FAMILIES = sorted({*SUPPORTED_MODEL_TYPES, *NOT_SUPPORTED})


@pytest.fixture(scope="module", params=_params(FAMILIES))
def family(request, tmp_path_factory):
    """(model_type, transformers' reference, the engine's model, a dict the tests share) for one family."""
    model_type = request.param
    reference = published_tiny_model(model_type)
    folder = save_tiny_model(reference, tmp_path_factory.mktemp(model_type))
    if is_multimodal(model_type):  # a vision-language checkpoint: transformers' own LM of it
        reference = AutoModelForCausalLM.from_pretrained(folder, **EAGER).eval()
    model = load_model(folder, _quarter_cached(reference))
    yield model_type, reference, model, {}  # the last: what one test leaves the next (plain greedy)
    model.close()


def _quarter_cached(reference) -> OffloadConfig:
    experts = [m for n, m in reference.named_modules() if n.endswith("experts") and hasattr(m, "num_experts")]
    total = sum(m.num_experts for m in experts)
    top_k = max(1, getattr(reference.config.get_text_config(), "num_experts_per_tok", 2) or 2)
    slots = max(total // 4, top_k)
    return OffloadConfig(
        device="cpu", dtype="float32", expert_budget=ExpertBudget.parse(str(slots)), sim_link_gbps=50.0
    )


def _prompt(vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab_size, 256), (PROMPT_LENGTH,), generator=generator).tolist()


def test_logits_and_greedy_tokens_equal_transformers(family):
    _, reference, model, shared = family
    prompt = _prompt(reference.config.get_text_config().vocab_size)
    shared["plain"] = assert_matches_reference(model, reference, prompt, NEW_TOKENS)


def test_lean_steps_are_the_forward_bit_for_bit(family):
    """Where the engine runs the decoder without transformers' wrappers (engine.decode.lean),
    a prompt's logits at every position, decode steps' and verifications' are the very ones
    transformers' forward gives on the same cache: the same operators on the same tensors. A
    prompt whose last position alone is kept runs the last layer's MLP on that row only: the same
    logits to its batch rounding. The families that take that path are the ones listed."""
    model_type, reference, model, _ = family
    assert (model.lean is not None) == (model_type in LEAN_FAMILIES), _lean_refusal(model)
    if model.lean is None:
        return
    prompt = torch.tensor([_prompt(reference.config.get_text_config().vocab_size)])
    through_hf, lean = model.new_kv_cache(), model.new_kv_cache()

    def forward(ids, keep):
        kwargs = with_cache(model.hf_model, through_hf, use_cache=True, logits_to_keep=keep)
        with torch.inference_mode():
            expected = model.hf_model(input_ids=ids, **kwargs).logits[0]
        return model.forward(ids.view(-1), lean, logits_to_keep=keep), expected

    assert torch.equal(*forward(prompt, 0))
    for tokens, keep in (([5], 1), ([9], 1), ([2, 7, 4], 0), ([8, 1], 0), ([3], 1)):  # decodes, verifications
        assert torch.equal(*forward(torch.tensor([tokens]), keep))
    assert lean.get_seq_length() == through_hf.get_seq_length() == prompt.shape[1] + 8
    through_hf, lean = model.new_kv_cache(), model.new_kv_cache()
    got, expected = forward(prompt, 1)  # a prefill keeping its last position
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _lean_refusal(model) -> str:
    from engine.decode.lean import _refusal

    return _refusal(model.hf_model) or "taken"


def test_greedy_self_speculation_is_plain_greedy(family):
    model_type, reference, model, shared = family
    prompt = _prompt(reference.config.get_text_config().vocab_size)
    greedy = {"max_new_tokens": NEW_TOKENS, "sampling": SamplingConfig(greedy=True), "ignore_eos": True}
    spec = SpecConfig(mode="self", top_r=1, draft_len=4)
    if model_type in NO_SPECULATION:  # not exact yet (SPEC_XFAIL): refused in one line, never wrong
        with pytest.raises(InvalidRequestError, match="cannot run on this model yet"):
            generate_text(model, prompt, GenerationConfig(**greedy, spec=spec))
        pytest.skip(f"speculation refused, as it should be: {SPEC_XFAIL[model_type]}")  # counts as plain only
    # plain greedy as the test before found it (transformers' own tokens), else run here
    plain = shared.get("plain") or generate_text(model, prompt, GenerationConfig(**greedy)).token_ids
    speculative = generate_text(model, prompt, GenerationConfig(**greedy, spec=spec))
    assert speculative.stats.verify_steps > 0
    assert list(speculative.token_ids) == list(plain)


def test_greedy_mtp_speculation_is_plain_greedy(family, tmp_path):
    """The family's model saved with an MTP layer (the same weights otherwise): `--spec mtp`
    gives plain greedy's tokens."""
    model_type, reference, _, shared = family
    if model_type not in MTP_FAMILIES:
        pytest.skip("its published checkpoints have no MTP layer the engine reads")
    folder = save_with_mtp(model_type, tmp_path / model_type)
    prompt = _prompt(reference.config.get_text_config().vocab_size)
    greedy = {"max_new_tokens": NEW_TOKENS, "sampling": SamplingConfig(greedy=True), "ignore_eos": True}
    spec = SpecConfig(mode="mtp", draft_len=3, confidence_tau=0.0)
    model = load_model(folder, _quarter_cached(reference))
    try:
        plain = shared.get("plain") or generate_text(model, prompt, GenerationConfig(**greedy)).token_ids
        speculative = generate_text(model, prompt, GenerationConfig(**greedy, spec=spec))
    finally:
        model.close()
    assert speculative.stats.verify_steps > 0 and speculative.stats.draft_len > 0
    assert list(speculative.token_ids) == list(plain)


def test_every_moe_family_of_the_registry_is_listed():
    """A family transformers adds is supported or refused with a reason, never silently dropped."""
    assert set(moe_model_types()) == set(FAMILIES)
    assert set(SPEC_XFAIL) == set(NO_SPECULATION)  # what the engine refuses is what cannot rewind
    assert not set(SUPPORTED_MODEL_TYPES) & set(NOT_SUPPORTED)


def test_the_readmes_family_list_names_only_supported_families():
    """The README's list is written by this file's run (conftest, MOE_CHAT_UPDATE_README=1)."""
    from tests.engine.model.conftest import END, README, START

    block = README.read_text(encoding="utf-8").split(START)[1].split(END)[0].split("\n\n")[0]
    listed = re.findall(r"`(\w+)`", block)
    assert listed, "run MOE_CHAT_UPDATE_README=1 python -m pytest tests/engine/model/test_all_families.py"
    assert set(listed) <= set(SUPPORTED_MODEL_TYPES) and int(block.split()[0]) == len(listed)
