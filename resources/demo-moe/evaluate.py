"""Measure the shipped demo models: `python resources/demo-moe/evaluate.py [--json OUT]`.

- held-out perplexity of target and draft (documents from a seed never trained on);
- five replies of the target, through MoE Chat's offloaded engine, to chat prompts;
- routing balance: each layer's share of top-k assignments per expert on held-out text;
- greedy speculative acceptance on held-out prompts: the draft model against the
  target, and the target's own top-1 self-draft (SS-MoE, r=1 < k=2): per-token
  agreement and the mean tokens per verify step for draft length 4 (bonus included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus  # noqa: E402
import train  # noqa: E402

SAMPLE_PROMPTS = [
    "What sound does a cow make?",
    "What is the capital of Italy?",
    "Tell me about lions.",
    "What is 4 plus 2?",
    "Write a short story about a bear.",
]


def routing_shares(target, blocks: torch.Tensor) -> list[list[float]]:
    """Per MoE layer, the share of top-k assignments each expert receives."""
    counts: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(target.model.layers):

        def record(_m, _i, out, index=index):
            top_k_index = out[2]
            counts[index] = counts.get(index, 0) + torch.bincount(
                top_k_index.flatten(), minlength=target.config.num_experts
            )

        hooks.append(layer.mlp.gate.register_forward_hook(record))
    with torch.no_grad():
        for i in range(0, len(blocks), 16):
            target(input_ids=blocks[i : i + 16])
    for hook in hooks:
        hook.remove()
    return [(c / c.sum()).tolist() for _, c in sorted(counts.items())]


@torch.no_grad()
def greedy_continuation(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def agreement(draft, target_ids: list[int], prompt_len: int) -> tuple[int, int]:
    """Positions where the draft's argmax equals the target's greedy token (teacher-forced)."""
    logits = draft(input_ids=torch.tensor([target_ids])).logits[0]
    predicted = logits[prompt_len - 1 : -1].argmax(-1)
    actual = torch.tensor(target_ids[prompt_len:])
    return int((predicted == actual).sum()), len(actual)


@torch.no_grad()
def speculative_chain(draft, target, prompt: list[int], new_tokens: int, draft_len: int = 4) -> list[int]:
    """Greedy speculative decoding (no KV cache; tiny models): tokens emitted per verify step."""
    ids, steps = list(prompt), []
    while len(ids) - len(prompt) < new_tokens:
        proposal = greedy_continuation(draft, ids, draft_len)
        verify = (
            target(input_ids=torch.tensor([ids + proposal])).logits[0, len(ids) - 1 :].argmax(-1).tolist()
        )
        accepted = 0
        while accepted < draft_len and proposal[accepted] == verify[accepted]:
            accepted += 1
        ids += [*proposal[:accepted], verify[accepted]]  # the target's own token (correction or bonus)
        steps.append(accepted + 1)
    return steps


def acceptance(draft, target, tokenizer, prompts: list[str]) -> dict:
    agree = total = 0
    steps: list[int] = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        continuation = greedy_continuation(target, ids, 48)
        a, t = agreement(draft, ids + continuation, len(ids))
        agree, total = agree + a, total + t
        steps += speculative_chain(draft, target, ids, 32)
    return {"token_agreement": agree / total, "mean_tokens_per_verify_step_len4": sum(steps) / len(steps)}


def sample_replies(folder: Path) -> list[dict]:
    from engine.config import ExpertBudget, OffloadConfig
    from engine.generation import GenerationConfig, generate_text
    from engine.loader import load_model
    from engine.sampling import SamplingConfig

    model = load_model(folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=24)))
    try:
        config = GenerationConfig(max_new_tokens=80, sampling=SamplingConfig(greedy=True))
        return [{"prompt": p, "reply": generate_text(model, p, config).text} for p in SAMPLE_PROMPTS]
    finally:
        model.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=HERE)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.models / "target")
    target = AutoModelForCausalLM.from_pretrained(args.models / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.models / "draft", dtype=torch.float32).eval()
    self_draft = AutoModelForCausalLM.from_pretrained(
        args.models / "target", dtype=torch.float32, num_experts_per_tok=1
    ).eval()
    heldout = [train.render(d) for d in corpus.documents(1_000_003, 2400)]
    blocks = train.token_blocks(tokenizer, heldout)
    shares = routing_shares(target, blocks)
    mean = 1 / target.config.num_experts
    prompts = corpus.heldout_prompts()
    result = {
        "target_heldout_perplexity": train.perplexity(target, blocks),
        "draft_heldout_perplexity": train.perplexity(draft, blocks),
        "routing_shares": shares,
        "routing_max_over_mean": [max(s) / mean for s in shares],
        "routing_unused_experts": [sum(1 for x in s if x == 0) for s in shares],
        "draft_acceptance": acceptance(draft, target, tokenizer, prompts),
        "self_draft_top1_acceptance": acceptance(self_draft, target, tokenizer, prompts),
        "samples": sample_replies(args.models / "target"),
    }
    print(json.dumps(result, indent=1, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
