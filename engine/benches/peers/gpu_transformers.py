#!/usr/bin/env python3
"""Peer benchmark on the GPU machine: HF transformers + torch, bf16, CUDA, sdpa attention, on a
random-weight Llama-3.2-1B-shaped model. The transformers side of the "GPU run" in
benchmarks/history/2026-11-21-gpu-run-plan.md.

Usage (on the GPU machine, which has torch and transformers but no network):
    python3 engine/benches/peers/gpu_transformers.py --out gpu-transformers.json \
        [--save-model DIR] [--repeats 3] [--quick]

Model: LlamaForCausalLM built from a config (no download) in the shape of
`fission make-random-model --shape llama-3.2-1b`: hidden 2048, 16 layers, 32/8 heads,
head_dim 64, FFN 8192, vocab 128256, rope_theta 500000, tied embeddings; weights ~ N(0, 0.02^2)
from torch.manual_seed(0), norms 1, bf16. --save-model writes it as an HF directory (config.json
+ model.safetensors, 2.5 GB) so that Fission can load the same weights in the same run.

Workload (the prompt rule and timing of bench_transformers.py, prompts.py):
  prefill_tok_s[n]      n in {512, 2048}: one forward, logits_to_keep=1, fresh cache; n / time.
  decode_batch_tok_s[B] B in {1, 8, 32, 64, 128}: B prompts of 32 tokens, 64 new tokens, greedy;
                        decode-only time from a forward hook (B * 63 tokens).
Every time is taken after torch.cuda.synchronize(). Figures are medians of --repeats runs after
one warm-up. Also reported: the bf16 weight bytes and the batch-1 decode's fraction of the HBM
roofline (weights + KV read per step / step time / --peak-gbs).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import batch_prompt_ids, prompt_ids  # noqa: E402

PREFILL_LENS = [512, 2048]
BATCH_SIZES = [1, 8, 32, 64, 128]
PROMPT_LEN, NEW_TOKENS = 32, 64


def log(msg: str) -> None:
    print(f"[gpu_transformers] {msg}", file=sys.stderr, flush=True)


def build_model(torch, transformers):
    cfg = transformers.LlamaConfig(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype=torch.bfloat16, device="cuda").eval(), cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-model", help="also write the model as an HF directory here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-gbs", type=float, default=3350.0, help="HBM GB/s (H100 SXM 3350, H200 4800)")
    ap.add_argument("--quick", action="store_true", help="smoke test: prefill 512, batches 1 and 8")
    args = ap.parse_args()

    import torch
    import transformers

    model, cfg = build_model(torch, transformers)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.1f}M params bf16 on {torch.cuda.get_device_name()}")
    if args.save_model:
        model.save_pretrained(args.save_model, safe_serialization=True)
        log(f"saved to {args.save_model}")

    gen = model.generation_config
    gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, None, None, None
    gen.pad_token_id = 0
    ends: list[float] = []

    def hook(_m, _i, _o):
        torch.cuda.synchronize()
        ends.append(time.perf_counter())

    model.register_forward_hook(hook)
    vocab = cfg.vocab_size

    def prefill_once(n: int) -> float:
        ids = torch.tensor([prompt_ids(n, vocab)], dtype=torch.long, device="cuda")
        torch.cuda.synchronize()
        with torch.inference_mode():
            t = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            return n / (time.perf_counter() - t)

    def decode_once(batch: int, new_tokens: int) -> float:
        ids = torch.tensor(batch_prompt_ids(batch, PROMPT_LEN, vocab), dtype=torch.long, device="cuda")
        g = copy.deepcopy(gen)
        g.max_new_tokens = g.min_new_tokens = new_tokens
        ends.clear()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=g)
        steps = len(ends) - 1  # the first forward is the prefill
        return batch * steps / (ends[-1] - ends[0])

    def median(fn, warmup) -> float:
        warmup()
        return round(statistics.median(fn() for _ in range(args.repeats)), 1)

    prefill = {}
    for n in [512] if args.quick else PREFILL_LENS:
        prefill[str(n)] = median(lambda n=n: prefill_once(n), lambda n=n: prefill_once(n))
        log(f"prefill {n}: {prefill[str(n)]:,} tok/s")
    decode = {}
    for b in [1, 8] if args.quick else BATCH_SIZES:
        decode[str(b)] = median(lambda b=b: decode_once(b, NEW_TOKENS), lambda b=b: decode_once(b, 4))
        log(f"decode batch {b}: {decode[str(b)]:,} tok/s")

    # Batch-1 decode reads every weight once per step plus the KV so far (~PROMPT_LEN + 32 rows).
    weight_bytes = n_params * 2
    kv_bytes = 16 * 2 * 8 * 64 * 2 * (PROMPT_LEN + NEW_TOKENS // 2)
    step_s = 1.0 / decode["1"]
    result = {
        "engine": "transformers",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "cuda": torch.version.cuda},
        "device": torch.cuda.get_device_name(),
        "dtype": "bf16",
        "model": "random llama-3.2-1b shape",
        "prefill_tok_s": prefill,
        "decode_batch_tok_s": decode,
        "decode_batch1_roofline_fraction": round((weight_bytes + kv_bytes) / step_s / 1e9 / args.peak_gbs, 3),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
