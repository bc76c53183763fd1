#!/usr/bin/env python3
"""Peer benchmark for benches/train.rs: the same LoRA training step in PyTorch + HF transformers.

    python3 benches/peer_train.py [--model models/smollm2-135m-instruct] [--threads 1] [--steps 3]
                                  [--case lora_binary_b8|lora_binary_b8_2k]

Same weights (the imported directory), same batch (the 4 chat prompts of benches/model.rs twice, each
with the same 64-token response, rewards +1/-1 alternating, rollout log-probs scored once untimed), LoRA
rank 16, alpha 32 on q,k,v,o,gate,up,down (base frozen), and the binary method's step as
src/trainer does it (docs/method.md section 6): full-vocabulary log-softmax at the response positions,
PPO-clipped policy gradient with eps 0.2 / eps_high 0.28 and advantage r, the mean over samples of each
sample's token mean,
entropy computed as a reported metric, backward, gradient-norm clipping at 1.0, AdamW (lr 1e-4, betas
0.9/0.98, weight decay 0.1). Prints a `BENCH {json}` line with tokens/s (prompt + response tokens per
step time, median of --steps after one warm-up step) and the process's peak resident set
(`ru_maxrss`). `--case lora_binary_b8_2k` prefixes each prompt with the passage of benches/train.rs so
prompt + response is 2,000 tokens (16,000 per step); `--steps 0` times the warm-up step alone.
`--micro 2 --grad-ckpt` is the memory-bounded way to run it (two samples per pass, as our 4,096-token
micro-batches hold, and transformers' gradient checkpointing): all 8 × 2,000 tokens in one pass without
checkpointing was killed by the kernel at 22.7 GB resident on a 24 GB machine. Needs
`torch` and `transformers`.
"""

import argparse
import json
import math
import resource
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

QUESTIONS = [
    "What is the capital of Germany?",
    "Write a haiku about rain.",
    "Explain photosynthesis briefly.",
    "List three prime numbers.",
]
RESPONSE = 64
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLinear(torch.nn.Module):
    def __init__(self, base, rank=16, alpha=32.0):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale


def attach_lora(model):
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in TARGETS:
                if hasattr(parent, name):
                    setattr(parent, name, LoraLinear(getattr(parent, name)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--case", default="lora_binary_b8", choices=["lora_binary_b8", "lora_binary_b8_2k"])
    ap.add_argument("--micro", type=int, default=8, help="samples per forward/backward pass (gradients accumulate)")
    ap.add_argument("--samples", type=int, default=8, choices=range(1, 9), help="the first N of the 8 samples (the bench's samples=N)")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (recompute each layer in backward)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(42)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    attach_lora(model)
    model.train()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True) for q in QUESTIONS]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    response = tok("The quick brown fox jumps over the lazy dog. " * 8).input_ids[:RESPONSE]
    if args.case == "lora_binary_b8_2k":
        passage = tok("Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in the chloroplasts of plant cells. " * 120).input_ids
        prompts = [passage[: 2000 - RESPONSE - len(p)] + p for p in prompts]
    n = args.samples
    seqs = [prompts[i % 4] + response for i in range(n)]
    plens = [len(prompts[i % 4]) for i in range(n)]
    width = max(len(s) for s in seqs)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    # positions predicting response token t: plen - 1 + t
    pos = torch.tensor([[p - 1 + t for t in range(RESPONSE)] for p in plens])
    resp = torch.tensor([response] * n)
    reward = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)])
    tokens = sum(len(s) for s in seqs)

    # Every row ends RESPONSE + 1 positions after its first predicting position when no row is padded
    # (the 2k case): then only those logits are computed (transformers' `logits_to_keep`), as a
    # practitioner would; the padded b8 case computes all positions and gathers.
    keep = RESPONSE + 1 if width == min(len(s) for s in seqs) else 0

    def logprobs(rows):
        logits = model(input_ids=ids[rows], attention_mask=mask[rows], logits_to_keep=keep).logits
        at_pos = pos[rows] - (width - keep) if keep else pos[rows]
        at = logits.gather(1, at_pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        full = torch.log_softmax(at.float(), -1)
        return full.gather(-1, resp[rows].unsqueeze(-1)).squeeze(-1), full

    micro = [list(range(i, min(i + args.micro, n))) for i in range(0, n, args.micro)]
    with torch.no_grad():
        old = torch.cat([logprobs(rows)[0] for rows in micro])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    if args.grad_ckpt:
        # recompute each decoder layer in the backward pass, as `[trainer] recompute_layers` does
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step():
        opt.zero_grad()
        total = 0.0
        for rows in micro:
            lp, full = logprobs(rows)
            ratio = torch.exp(lp - old[rows])
            adv = reward[rows].unsqueeze(-1)
            pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.28))
            # the step's loss is the mean over its n samples of each sample's token mean
            loss = pg.mean(-1).sum() / n
            with torch.no_grad():
                _entropy = -(full.exp() * full).sum(-1).mean(-1).sum() / n
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return total

    t0 = time.perf_counter()
    step()  # warm-up
    warmup_s = time.perf_counter() - t0
    times, loss = [], float("nan")
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    times.sort()
    med = times[len(times) // 2] if times else float("nan")
    print("BENCH " + json.dumps({"bench": "train", "case": args.case, "engine": f"pytorch {torch.__version__} + transformers",
                                 "threads": args.threads, "samples": n, "tokens": tokens, "response_tokens": n * RESPONSE, "steps": args.steps, "micro_batch_samples": args.micro, "gradient_checkpointing": args.grad_ckpt,
                                 "best_s": times[0] if times else float("nan"), "median_s": med, "warmup_s": warmup_s,
                                 "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "tokens_s": tokens / med, "response_tokens_s": n * RESPONSE / med,
                                 "last_loss": loss}))


if __name__ == "__main__":
    main()
