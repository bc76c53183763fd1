#!/usr/bin/env python3
"""Peer benchmark: the same work as benches/model.rs with Python HF `transformers` (PyTorch, CPU)
loading the same imported directory, so both runtimes can be compared in one run.

    python3 benches/peer_model.py [--model models/smollm2-135m-instruct] [--threads 1] [--repeats 3]

Reports tokens/s for: greedy generation of 32 tokens at batch 1, sampled generation (temperature 0.7,
top-p 0.95) of 32 tokens at batch 4 (left padding), and scoring 4 (prompt, 64-token response) pairs
(one forward pass + log-softmax gather). Also prints the greedy continuation of "The capital of France
is" and the log-prob of " Paris" there, which the Rust runtime must reproduce (a cross-check of the
GGUF import). Needs `torch` and `transformers` (test/bench dependencies, not used by nextstate).
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 32
SCORE_RESPONSE = 64
QUESTIONS = [
    "What is the capital of Germany?",
    "Write a haiku about rain.",
    "Explain photosynthesis briefly.",
    "List three prime numbers.",
]


def timed(fn, repeats):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()

    with torch.no_grad():
        # Cross-check of the import: plain-text greedy continuation and the log-prob of " Paris".
        ids = tok("The capital of France is", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        print("greedy continuation:", repr(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
        logp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        paris = tok(" Paris").input_ids[0]
        print(f"log p(' Paris' | prompt) = {logp[paris].item():.6f}")

        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) for q in QUESTIONS]
        tok.padding_side = "left"
        one = tok(prompts[:1], return_tensors="pt")
        four = tok(prompts, return_tensors="pt", padding=True)
        common = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=tok.pad_token_id)

        def greedy():
            model.generate(**one, do_sample=False, **common)

        def sampled():
            torch.manual_seed(1)
            model.generate(**four, do_sample=True, temperature=0.7, top_p=0.95, **common)

        response = tok("The quick brown fox jumps over the lazy dog. " * 8).input_ids[:SCORE_RESPONSE]
        seqs = [tok(p).input_ids + response for p in prompts]
        width = max(len(s) for s in seqs)
        batch = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        scored_tokens = sum(len(s) for s in seqs)

        def score():
            logits = model(batch).logits.float()
            lp = torch.log_softmax(logits, -1)
            for i, s in enumerate(seqs):
                p = len(s) - SCORE_RESPONSE
                lp[i, p - 1 : len(s) - 1].gather(-1, torch.tensor(response).unsqueeze(-1))

        for name, fn, n in [
            ("generate_greedy_b1", greedy, NEW_TOKENS),
            ("generate_sampled_b4", sampled, 4 * NEW_TOKENS),
            ("score_b4", score, scored_tokens),
        ]:
            s = timed(fn, args.repeats)
            print(f"transformers {name}: {n} tokens in {s:.3f} s = {n / s:.1f} tokens/s")
            print("BENCH " + json.dumps({"bench": "model", "case": name, "engine": "transformers", "threads": args.threads, "tokens": n, "best_s": s, "tokens_s": n / s}))


if __name__ == "__main__":
    main()
