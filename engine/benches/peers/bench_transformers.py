#!/usr/bin/env python3
"""Peer benchmark: HF transformers on torch CPU, float32, sdpa attention.

Usage:
    .peers/venv/bin/python engine/benches/peers/bench_transformers.py --model DIR --out JSON \
        [--threads 2] [--repeats 3] [--quick]

PROMPT RULE (the Rust bench must mirror it exactly; implemented in prompts.py):
    prompt of length n, batch element b (b = 0 for prefill and single-stream), position i:
        ids[i] = 3 + ((i * 7919 + 13 + b * 104729) % (vocab - 3))
    vocab = config.json vocab_size; no BOS is prepended; all prompts in a batch have the same
    length, so there is no padding and the attention mask is all ones.

What is measured (full mode):
  prefill_tok_s[n]      n in {128, 512, 2048} (lengths above max_position_embeddings -> null):
                        one forward over an n-token prompt with logits_to_keep=1 and a fresh KV
                        cache; tok/s = n / wall time.
  decode_single_tok_s   greedy generate, 32-token prompt, 128 new tokens
                        (min_new_tokens = max_new_tokens). Decode-only: a forward hook stamps the end
                        of every forward; time = end of last forward - end of the prefill forward,
                        tokens = number of decode forwards (127). Includes generate()'s per-step
                        overhead (logits processing, cache bookkeeping), excludes prefill.
  decode_batch_tok_s[B] B in {1, 8, 32, 64}: same as above with B prompts of 32 tokens and 64 new
                        tokens each; tokens = B * (decode forwards) = B * 63.
Each figure is the median of --repeats runs (default 3) after one warm-up run of the same shape
(decode warm-ups generate only a few tokens). --quick: 1 repeat, prefill 128 only, single decode of
32 tokens, batches {1, 8} with 16 new tokens: a smoke test, not comparable figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import batch_prompt_ids, prompt_ids  # noqa: E402

PREFILL_LENS = [128, 512, 2048]
SINGLE_PROMPT_LEN, SINGLE_NEW = 32, 128
BATCH_SIZES = [1, 8, 32, 64]
BATCH_PROMPT_LEN, BATCH_NEW = 32, 64


def log(msg: str) -> None:
    print(f"[bench_transformers] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class ForwardTimer:
    """Records perf_counter() at the end of every forward of the wrapped module."""

    def __init__(self, module):
        self.ends: list[float] = []
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, _output):
        self.ends.append(time.perf_counter())

    def reset(self) -> None:
        self.ends.clear()

    def remove(self) -> None:
        self._handle.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3, --quick 1)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, small sets")
    args = ap.parse_args()

    # Thread counts must be fixed before torch spins up its pools.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass

    repeats = args.repeats or (1 if args.quick else 3)
    prefill_lens = [128] if args.quick else PREFILL_LENS
    single_new = 32 if args.quick else SINGLE_NEW
    batch_sizes = [1, 8] if args.quick else BATCH_SIZES
    batch_new = 16 if args.quick else BATCH_NEW

    model_dir = Path(args.model).resolve()
    config = AutoConfig.from_pretrained(model_dir)
    vocab = int(config.vocab_size)
    max_pos = int(getattr(config, "max_position_embeddings", 1 << 30))

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    load_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    log(f"loaded {model_dir.name}: {n_params / 1e6:.1f}M params, vocab {vocab}, "
        f"max_pos {max_pos}, in {load_s:.1f}s; threads={torch.get_num_threads()}")

    # generate() settings: greedy, fixed length, no early stop. pad id only silences warnings.
    gen_cfg = model.generation_config
    gen_cfg.do_sample = False
    gen_cfg.temperature = None
    gen_cfg.top_p = None
    gen_cfg.top_k = None
    if gen_cfg.pad_token_id is None:
        eos = gen_cfg.eos_token_id if gen_cfg.eos_token_id is not None else config.eos_token_id
        gen_cfg.pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    timer = ForwardTimer(model)
    details: dict = {"prefill": {}, "decode_single": {}, "decode_batch": {}}
    notes: list[str] = []

    def prefill_once(n: int) -> float:
        ids = torch.tensor([prompt_ids(n, vocab)], dtype=torch.long)
        with torch.inference_mode():
            t = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t
        assert out.logits.shape[1] == 1, out.logits.shape
        return n / dt

    def decode_once(batch: int, prompt_len: int, new_tokens: int) -> tuple[float, dict]:
        ids = torch.tensor(batch_prompt_ids(batch, prompt_len, vocab), dtype=torch.long)
        mask = torch.ones_like(ids)
        cfg = copy.deepcopy(gen_cfg)
        cfg.max_new_tokens = new_tokens
        cfg.min_new_tokens = new_tokens
        timer.reset()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        generated = out.shape[1] - prompt_len
        if generated != new_tokens:
            raise RuntimeError(f"generated {generated} tokens, wanted {new_tokens}")
        forwards = len(timer.ends)
        if forwards != new_tokens:
            raise RuntimeError(f"timing hook saw {forwards} forwards for {new_tokens} tokens")
        decode_steps = forwards - 1  # the first forward is the prefill
        decode_s = timer.ends[-1] - timer.ends[0]
        return batch * decode_steps / decode_s, {"decode_steps": decode_steps, "decode_s": round(decode_s, 4)}

    load_log: dict[str, list[float]] = {}

    def run(label: str, fn, warmup) -> tuple[float, list[float]]:
        load_before = os.getloadavg()[0]
        warmup()
        rates = [fn() for _ in range(repeats)]
        med = statistics.median(rates)
        # 1-minute load average before and after: other processes on a 2-core box skew the figures.
        load_log[label] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        log(f"{label}: {med:,.1f} tok/s (runs: {', '.join(f'{r:,.1f}' for r in rates)}; "
            f"load {load_log[label][0]} -> {load_log[label][1]})")
        return med, rates

    bench_t0 = time.perf_counter()

    # Prefill -----------------------------------------------------------------------------------
    prefill: dict[str, float | None] = {str(n): None for n in PREFILL_LENS}
    for n in prefill_lens:
        if n > max_pos:
            notes.append(f"prefill {n} skipped: above max_position_embeddings={max_pos}")
            log(notes[-1])
            continue
        med, rates = run(f"prefill {n}", lambda n=n: prefill_once(n), lambda n=n: prefill_once(n))
        prefill[str(n)] = round(med, 2)
        details["prefill"][str(n)] = [round(r, 2) for r in rates]

    # Single-stream decode ----------------------------------------------------------------------
    med, rates = run(
        f"decode single ({SINGLE_PROMPT_LEN} prompt, {single_new} new)",
        lambda: decode_once(1, SINGLE_PROMPT_LEN, single_new)[0],
        lambda: decode_once(1, SINGLE_PROMPT_LEN, 8),
    )
    decode_single = round(med, 2)
    details["decode_single"] = {"prompt_len": SINGLE_PROMPT_LEN, "new_tokens": single_new,
                                "runs": [round(r, 2) for r in rates]}

    # Batched decode ----------------------------------------------------------------------------
    decode_batch: dict[str, float | None] = {str(b): None for b in BATCH_SIZES}
    for b in batch_sizes:
        med, rates = run(
            f"decode batch {b} ({BATCH_PROMPT_LEN} prompt, {batch_new} new)",
            lambda b=b: decode_once(b, BATCH_PROMPT_LEN, batch_new)[0],
            lambda b=b: decode_once(b, BATCH_PROMPT_LEN, 4),
        )
        decode_batch[str(b)] = round(med, 2)
        details["decode_batch"][str(b)] = [round(r, 2) for r in rates]
    details["decode_batch"]["prompt_len"] = BATCH_PROMPT_LEN
    details["decode_batch"]["new_tokens"] = batch_new

    timer.remove()
    bench_s = time.perf_counter() - bench_t0
    load = os.getloadavg()
    notes[:0] = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, float32, sdpa, "
        f"{torch.get_num_threads()} threads, {cpu_model()}",
        f"median of {repeats} run(s) after a warm-up; decode figures are decode-only (prefill forward excluded)",
        f"bench wall {bench_s:.0f}s; loadavg at end {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}",
    ]
    if args.quick:
        notes.append(f"QUICK MODE: single decode {single_new} new tokens, batch decode {batch_new} new tokens; "
                     "not comparable with full runs")

    result = {
        "engine": "transformers",
        "model": model_dir.name,
        "prefill_tok_s": prefill,
        "decode_single_tok_s": decode_single,
        "decode_batch_tok_s": decode_batch,
        "notes": "; ".join(notes),
        "details": {**details, "load1_before_after": load_log, "repeats": repeats, "threads": args.threads, "quick": args.quick,
                    "params": n_params, "bench_wall_s": round(bench_s, 1)},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out} (bench wall {bench_s:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
