#!/usr/bin/env python3
"""PEFT parity of nextstate's LoRA checkpoints (issue 16): Hugging Face `peft` + `transformers` load an
adapter folder written by nextstate (`LanguageModel::save_adapters`, the layout of every LoRA
checkpoint) on the base model and must give the logits nextstate computes, within 1e-4.

Steps:
  1. `cargo test --test model_train peft_parity_fixture -- --ignored` writes into WORK the PEFT folder
     `adapter/` (SmolLM2-135M-Instruct, r 8, alpha 20, B nonzero) and `ours.safetensors` (`input_ids`,
     nextstate's `logits` with the adapters attached, `logits_merged` as `nextstate serve` runs it, and
     `logits_base` of the base model alone).
  2. `PeftModel.from_pretrained(base, WORK/adapter)`; every adapter tensor PEFT loaded must equal the file
     (same keys: nothing missing, nothing ignored).
  3. Logits of PEFT (adapters unmerged, then `merge_and_unload`) against ours, f32 on the CPU.

Prints one `BENCH {json}` line (the format scripts/bench_report.py reads); exits 1 when a difference exceeds --tol.
Needs torch, transformers, peft and safetensors (test dependencies, not used by nextstate):

    python3 -m venv .cache/venv-peft && .cache/venv-peft/bin/pip install torch peft transformers safetensors
    .cache/venv-peft/bin/python scripts/peft_parity.py
"""

import argparse
import json
import os
import subprocess
import sys

import peft
import torch
import transformers
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct", help="base model directory (HF layout)")
    ap.add_argument("--work", default=os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "peft-parity"), help="fixture folder")
    ap.add_argument("--skip-fixture", action="store_true", help="reuse WORK instead of running the cargo test")
    ap.add_argument("--tol", type=float, default=1e-4, help="maximum absolute logit difference")
    args = ap.parse_args()
    torch.set_num_threads(1)

    if not args.skip_fixture:
        os.makedirs(args.work, exist_ok=True)
        env = dict(os.environ, NEXTSTATE_PEFT_PARITY_DIR=os.path.abspath(args.work), NEXTSTATE_TEST_MODEL=os.path.abspath(args.model))
        cmd = ["cargo", "test", "--test", "model", "peft_parity_fixture", "--", "--ignored", "--exact"]
        print("peft_parity: " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, env=env, check=True)

    adapter = os.path.join(args.work, "adapter")
    ours = load_file(os.path.join(args.work, "ours.safetensors"))
    ids = ours["input_ids"]

    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        base_logits = base(ids).logits
    model = PeftModel.from_pretrained(base, adapter).eval()
    cfg = model.peft_config["default"]
    # The scale PEFT applies (lora_alpha / r, or / sqrt(r) under use_rslora); ours is alpha / r.
    scaling = model.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"]

    # What PEFT loaded is exactly the file: same keys (its own naming), same values.
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    loaded = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()}
    if set(saved) != set(loaded):
        print(f"peft_parity: key mismatch: only in file {sorted(set(saved) - set(loaded))[:3]}, only in peft {sorted(set(loaded) - set(saved))[:3]}", file=sys.stderr)
        return 1
    weights_diff = max((saved[k].float() - loaded[k].float()).abs().max().item() for k in saved)

    with torch.no_grad():
        peft_logits = model(ids).logits
        merged = model.merge_and_unload()
        merged_logits = merged(ids).logits
    diff = (peft_logits - ours["logits"]).abs().max().item()
    diff_merged = (merged_logits - ours["logits_merged"]).abs().max().item()
    effect = (peft_logits - base_logits).abs().max().item()
    # The two runtimes' difference on the base model alone: the floor any adapter comparison sits on.
    diff_base = (base_logits - ours["logits_base"]).abs().max().item()
    summary = {
        "case": "peft_parity",
        "tokens": ids.shape[1],
        "adapter_tensors": len(saved),
        "scaling": scaling,
        "r": cfg.r,
        "lora_alpha": cfg.lora_alpha,
        "loaded_weights_max_abs_diff": weights_diff,
        "logits_max_abs_diff": diff,
        "merged_logits_max_abs_diff": diff_merged,
        "base_logits_max_abs_diff": diff_base,
        "adapter_effect_max_abs_logit": effect,
        "tol": args.tol,
        "torch": torch.__version__,
        "peft": peft.__version__,
        "transformers": transformers.__version__,
    }
    print("BENCH " + json.dumps(summary))
    ok = weights_diff == 0.0 and scaling == cfg.lora_alpha / cfg.r and diff <= args.tol and diff_merged <= args.tol and effect > 10 * args.tol
    if not ok:
        print("peft_parity: FAILED (weights must load exactly, logits within tol, and the adapter must change the logits)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
