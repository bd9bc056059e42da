"""Regenerate the demo models from scratch: `python resources/demo-moe/train.py`.

1. corpus: documents from `corpus.py` (script-generated, seeded);
2. tokenizer: byte-level BPE (4,096 tokens) with a ChatML chat template;
3. target: a `qwen3_moe` model, 6 layers × 16 routed experts, top-2, trained with a
   per-layer load-balancing loss so no layer's routing collapses;
4. draft: a dense `qwen3` model with the same tokenizer and hidden size (SP-MoE
   feeds the draft's hidden states to the target's routers);
5. both saved in bf16 under `target/` and `draft/`, with `train_log.json`.

Deterministic for a seed on a given machine (one process, fixed thread count).
The defaults take about 45 minutes on 2 CPU cores; `--quick` is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
BALANCE_COEF = 0.05
VOCAB_SIZE = 4096
SEQ_LEN = 192
HIDDEN = 192


def render(doc: corpus.Document) -> str:
    """A document as training text: conversations in ChatML (as the template renders them)."""
    if isinstance(doc, str):
        return doc + "<|endoftext|>"
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in doc) + "<|endoftext|>"


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def token_blocks(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts concatenated and cut into [N, SEQ_LEN] blocks."""
    ids = [i for text in texts for i in tokenizer(text)["input_ids"]]
    n = len(ids) // SEQ_LEN
    return torch.tensor(ids[: n * SEQ_LEN]).view(n, SEQ_LEN)


def _shared_config(tokenizer) -> dict:
    """What target and draft have in common: tokenizer, hidden size (SP-MoE feeds the draft's
    hidden states to the target's routers), attention shape and special tokens."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": HIDDEN,
        "intermediate_size": 512,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
    }


def target_config(tokenizer) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **_shared_config(tokenizer),
        moe_intermediate_size=96,
        num_hidden_layers=6,
        num_experts=16,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        # Balancing is done per layer in fit(): transformers' loss balances all layers pooled,
        # which lets single layers collapse onto a few experts.
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    )


def draft_config(tokenizer) -> Qwen3Config:
    return Qwen3Config(**_shared_config(tokenizer), num_hidden_layers=2)


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-Transformer load balancing, per layer and averaged: E * sum_i f_i * P_i
    (f_i: share of top-k assignments to expert i, P_i: its mean router probability); 1 when even."""
    losses = []
    for logits in router_logits:  # each [T, E]
        probs = logits.float().softmax(dim=-1)
        chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
        share = chosen.mean(dim=0) / top_k  # [E]
        losses.append(probs.shape[-1] * (share * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def fit(model, blocks: torch.Tensor, steps: int, batch: int, lr: float, seed: int, label: str) -> list[dict]:
    """AdamW with warm-up and cosine decay over random batches; progress on stdout."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    order = torch.Generator().manual_seed(seed)
    model.train()
    log, start = [], time.perf_counter()
    for step in range(steps):
        x = blocks[torch.randint(0, len(blocks), (batch,), generator=order)]
        is_moe = hasattr(model.config, "num_experts")
        out = model(input_ids=x, labels=x, output_router_logits=is_moe)
        balance = balance_loss(out.router_logits, model.config.num_experts_per_tok) if is_moe else None
        loss = out.loss + BALANCE_COEF * balance if is_moe else out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        lr_schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            aux = balance
            entry = {"step": step, "loss": round(out.loss.item(), 4), "elapsed_s": round(elapsed, 1)}
            if aux is not None:
                entry["aux_loss"] = round(aux.item(), 4)
            log.append(entry)
            eta = elapsed / (step + 1) * (steps - step - 1)
            print(f"[{label}] step {step}/{steps} loss {entry['loss']:.3f} "
                  f"{'aux ' + str(entry.get('aux_loss')) + ' ' if aux is not None else ''}"
                  f"eta {eta / 60:.1f} min", flush=True)  # fmt: skip
    model.eval()
    return log


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch: int = 16) -> float:
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch):
        x = blocks[i : i + batch]
        loss = model(input_ids=x, labels=x).loss
        n = x.numel() - len(x)
        total, count = total + loss.item() * n, count + n
    return math.exp(total / count)


def save(model, tokenizer, folder: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", type=int, default=120_000)
    parser.add_argument("--target-steps", type=int, default=2400)
    parser.add_argument("--draft-steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a 2-minute smoke run (tiny corpus, few steps)")
    args = parser.parse_args(argv)
    if args.quick:  # explicit sizes given with --quick still win
        given = set(argv or sys.argv[1:])
        args.documents = args.documents if "--documents" in given else 3000
        args.target_steps = args.target_steps if "--target-steps" in given else 30
        args.draft_steps = args.draft_steps if "--draft-steps" in given else 30
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    started = time.perf_counter()

    texts = [render(d) for d in corpus.documents(args.seed, args.documents)]
    heldout = [render(d) for d in corpus.documents(args.seed + 1_000_003, max(200, args.documents // 50))]
    print(f"corpus: {len(texts)} training and {len(heldout)} held-out documents", flush=True)
    tokenizer = train_tokenizer(texts)
    train_blocks, heldout_blocks = token_blocks(tokenizer, texts), token_blocks(tokenizer, heldout)
    print(f"tokens: {train_blocks.numel():,} training, {heldout_blocks.numel():,} held out", flush=True)

    target = Qwen3MoeForCausalLM(target_config(tokenizer))
    target.set_experts_implementation("grouped_mm")
    target_log = fit(target, train_blocks, args.target_steps, args.batch, 2e-3, args.seed, "target")
    draft = Qwen3ForCausalLM(draft_config(tokenizer))
    draft_log = fit(draft, train_blocks, args.draft_steps, args.batch, 2e-3, args.seed + 1, "draft")

    result = {
        "seed": args.seed,
        "documents": len(texts),
        "train_tokens": train_blocks.numel(),
        "heldout_tokens": heldout_blocks.numel(),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "target_heldout_perplexity": perplexity(target, heldout_blocks),
        "draft_heldout_perplexity": perplexity(draft, heldout_blocks),
        "target_log": target_log,
        "draft_log": draft_log,
        "minutes": (time.perf_counter() - started) / 60,
    }
    print(
        f"held-out perplexity: target {result['target_heldout_perplexity']:.3f}, "
        f"draft {result['draft_heldout_perplexity']:.3f}; {result['minutes']:.1f} min",
        flush=True,
    )
    save(target, tokenizer, args.out / "target")
    save(draft, tokenizer, args.out / "draft")
    (args.out / "train_log.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
