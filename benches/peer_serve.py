#!/usr/bin/env python3
"""Peer of benches/serve.rs: the same requests answered by Hugging Face `transformers` (PyTorch, CPU,
one thread) with batched `generate`, as a server without continuous batching does it.

    python3 benches/peer_serve.py [--model models/smollm2-135m-instruct] [--clients 1,4,8] [--requests 6]

With N clients, request j of client c is the same (prompt, max_tokens) as in benches/serve.rs (entry
(c * 5 + j) % 12 of benches/serve_workload.json, chat template, greedy). transformers has no server and no continuous
batching, so the N clients' j-th requests form one batch (left padding), generated with the largest
max_tokens of the batch and each row cut at its own limit or end of sequence: the best a static server
does when all N clients ask at once, which closed-loop clients of a static server do. tokens/s counts
each request's own tokens only; TTFT is from the batch's start to its first generated token (a
streamer's second `put`), latency to the batch's end. Prints `BENCH {json}` lines like the Rust bench,
with `peak_rss_mb` (ru_maxrss) at the end of each client count. Needs `torch` and `transformers`.
"""

import argparse
import json
import os
import resource
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# The (prompt, max_tokens) pairs benches/serve.rs sends too.
WORKLOAD = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_workload.json")))


class FirstToken:
    """A generate() streamer that records when the first generated token arrives."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first put is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = max(1, min(len(xs), -(-p * len(xs) // 100)))
    return xs[int(k) - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    render = lambda q: tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        warm = tok([render(WORKLOAD[0][0])], return_tensors="pt")
        model.generate(**warm, max_new_tokens=8, do_sample=False)
        for n in [int(c) for c in args.clients.split(",")]:
            ttft, lat, tokens = [], [], 0
            t0 = time.perf_counter()
            for j in range(args.requests):
                batch = [WORKLOAD[(c * 5 + j) % len(WORKLOAD)] for c in range(n)]
                enc = tok([render(q) for q, _ in batch], return_tensors="pt", padding=True)
                streamer = FirstToken()
                start = time.perf_counter()
                out = model.generate(**enc, max_new_tokens=max(m for _, m in batch), do_sample=False, streamer=streamer, pad_token_id=tok.pad_token_id)
                end = time.perf_counter()
                new = out[:, enc.input_ids.shape[1]:]
                for row, (_, limit) in zip(new.tolist(), batch):
                    k = 0
                    for t in row[:limit]:
                        k += 1
                        if t in eos:
                            break
                    tokens += k
                    ttft.append(((streamer.first or end) - start) * 1e3)
                    lat.append((end - start) * 1e3)
            wall = time.perf_counter() - t0
            print("BENCH " + json.dumps({
                "bench": "serve_peer", "mode": "transformers", "clients": n, "requests": n * args.requests, "tokens": tokens,
                "seconds": wall, "tokens_per_s": tokens / wall,
                "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
                "latency_p50_ms": pct(lat, 50), "latency_p90_ms": pct(lat, 90),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
            }), flush=True)


if __name__ == "__main__":
    main()
