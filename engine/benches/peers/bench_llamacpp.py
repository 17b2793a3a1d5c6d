#!/usr/bin/env python3
"""Peer benchmark: llama.cpp (the tree vendored in the llama-cpp-python sdist), CPU, f32 weights
(or Q8_0 with --outtype q8_0, the peer of Fission's --quantize int8).

Usage:
    .peers/venv/bin/python engine/benches/peers/bench_llamacpp.py --model DIR --out JSON \
        [--outtype f32|q8_0|q4_k_m] [--threads 2] [--repeats 3] [--quick] [--peers-dir .peers]
    .peers/venv/bin/python engine/benches/peers/bench_llamacpp.py --gguf FILE --out JSON \
        [--prefill 512] [--batch 1,32]      # a GGUF file as it is (the Llama-3.2-1B-shaped rows)

Needs engine/benches/peers/setup.sh to have run (venv, .peers/llama.cpp, build/bin tools).

Steps:
  1. Convert DIR to GGUF with the vendored convert_hf_to_gguf.py --outtype f32 (or q8_0: blocks of
     32 weights with an f16 scale, quantised by the converter from the checkpoint's values). The
     file is cached as .peers/gguf/<basename>-<key>.gguf (q8_0: <basename>-<key>-q8_0.gguf),
     where key hashes DIR's absolute path and the size and mtime of its config, tokenizer and
     safetensors files, so a rewritten model is reconverted.
  2. prefill_tok_s:       llama-bench -m F -t 2 -p 128,512,2048 -n 0 -o json
                          (lengths above max_position_embeddings are left out -> null). Median of
                          llama-bench's per-repetition samples (-r 5 by default).
  3. decode_single_tok_s: llama-bench -m F -t 2 -p 0 -n 128 -d 32 -o json
                          (128 generated tokens after a 32-token context; decode only).
  4. decode_batch_tok_s:  llama-batched-bench -m F -t 2 -tb 2 -c 8192 -npp 32 -ntg 64 -npl 1,8,32,64
                          S_TG column (= B * 64 / time of the 64 decode steps: decode only). Run
                          --repeats times; median per batch size.
llama.cpp keeps its KV cache in f16 (its default); transformers keeps it in f32.
llama-bench feeds random token ids, not the PROMPT RULE ids used by bench_transformers.py; with
dense f32 weights the speed does not depend on the ids.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPT_DIR.parents[2]

PREFILL_LENS = [128, 512, 2048]
SINGLE_DEPTH, SINGLE_NEW = 32, 128
BATCH_SIZES = [1, 8, 32, 64]
BATCH_PROMPT_LEN, BATCH_NEW = 32, 64


def log(msg: str) -> None:
    print(f"[bench_llamacpp] {msg}", file=sys.stderr, flush=True)


# (command name, 1-minute load average before, after): other processes on a 2-core box skew the figures.
LOAD_LOG: list[tuple[str, float, float]] = []


def run_cmd(cmd: list[str], **kw) -> str:
    log("$ " + " ".join(cmd))
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + "\n" + proc.stderr[-4000:] + "\n")
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
    LOAD_LOG.append((Path(cmd[0]).name, round(load_before, 2), round(os.getloadavg()[0], 2)))
    return proc.stdout


def model_key(model_dir: Path) -> str:
    h = hashlib.sha256(str(model_dir).encode())
    for p in sorted(model_dir.iterdir()):
        if p.suffix in (".json", ".safetensors", ".model") and p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def convert(model_dir: Path, peers: Path, python: str, outtype: str) -> tuple[Path, float | None]:
    if outtype == "q4_k_m":
        # llama-quantize from the f32 file, as users make Q4_K_M (Q6_K and fallbacks included).
        src, _ = convert(model_dir, peers, python, "f32")
        out = src.with_name(src.stem + "-q4_k_m.gguf")
        if out.exists():
            log(f"using cached {out}")
            return out, None
        t0 = time.perf_counter()
        tmp = out.with_suffix(".gguf.tmp")
        run_cmd([str(peers / "llama.cpp" / "build" / "bin" / "llama-quantize"), str(src), str(tmp), "Q4_K_M", "2"])
        tmp.rename(out)
        return out, time.perf_counter() - t0
    suffix = "" if outtype == "f32" else f"-{outtype}"
    out = peers / "gguf" / f"{model_dir.name}-{model_key(model_dir)}{suffix}.gguf"
    if out.exists():
        log(f"using cached {out}")
        return out, None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".gguf.tmp")
    t0 = time.perf_counter()
    run_cmd([python, str(peers / "llama.cpp" / "convert_hf_to_gguf.py"), str(model_dir),
             "--outtype", outtype, "--outfile", str(tmp)])
    tmp.rename(out)
    dt = time.perf_counter() - t0
    log(f"converted to {out} in {dt:.1f}s ({out.stat().st_size / 1e6:.0f} MB)")
    return out, dt


def llama_bench(binary: Path, gguf: Path, threads: int, extra: list[str]) -> list[dict]:
    out = run_cmd([str(binary), "-m", str(gguf), "-t", str(threads), *extra, "-o", "json"])
    return json.loads(out)


def median_ts(entry: dict) -> float:
    samples = entry.get("samples_ts") or [entry["avg_ts"]]
    return statistics.median(samples)


def parse_batched_bench(text: str) -> dict[int, dict]:
    """Parses llama-batched-bench --output-format jsonl into {B: row}; S_TG is row["speed_tg"]."""
    rows: dict[int, dict] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            rows[int(row["pl"])] = row
    if not rows:
        raise RuntimeError("no rows in llama-batched-bench output:\n" + text[-2000:])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model directory (converted to GGUF)")
    ap.add_argument("--gguf", help="run this GGUF file as it is instead of converting --model")
    ap.add_argument("--prefill", help="prompt lengths, comma-separated (default 128,512,2048)")
    ap.add_argument("--batch", help="batch sizes of llama-batched-bench, comma-separated (default 1,8,32,64)")
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--outtype", choices=["f32", "q8_0", "q4_k_m"], default="f32",
                    help="weights of the GGUF: f32, or q8_0 (llama.cpp's int8 with a scale per 32)")
    ap.add_argument("--convert-only", action="store_true",
                    help="print the GGUF's path (converting it if needed) and exit: the file Fission runs too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None,
                    help="llama-bench -r and llama-batched-bench runs (default: 5 and 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, small sets")
    ap.add_argument("--peers-dir", default=str(REPO_ROOT / ".peers"))
    ap.add_argument("--build", default="build",
                    help="llama.cpp build folder under .peers/llama.cpp (build-avx2: LLAMA_ISA=avx2 in setup.sh)")
    args = ap.parse_args()

    peers = Path(args.peers_dir).resolve()
    bindir = peers / "llama.cpp" / args.build / "bin"
    bench_bin, batched_bin = bindir / "llama-bench", bindir / "llama-batched-bench"
    for b in (bench_bin, batched_bin):
        if not b.exists():
            raise SystemExit(f"{b} missing: run engine/benches/peers/setup.sh first")
    venv_py = peers / "venv" / "bin" / "python"
    python = str(venv_py) if venv_py.exists() else sys.executable

    if (args.model is None) == (args.gguf is None):
        raise SystemExit("give one of --model DIR and --gguf FILE")
    model_dir = Path(args.model).resolve() if args.model else None
    max_pos = 1 << 30
    if model_dir is not None:
        cfg = json.loads((model_dir / "config.json").read_text())
        max_pos = int(cfg.get("max_position_embeddings", max_pos))

    bench_reps = args.repeats or (1 if args.quick else 5)
    batched_runs = args.repeats or (1 if args.quick else 3)
    prefill_lens = [128] if args.quick else PREFILL_LENS
    if args.prefill:
        prefill_lens = [int(x) for x in args.prefill.split(",")]
    single_new = 32 if args.quick else SINGLE_NEW
    batch_sizes = [1, 8] if args.quick else BATCH_SIZES
    if args.batch:
        batch_sizes = [int(x) for x in args.batch.split(",")]
    batch_new = 16 if args.quick else BATCH_NEW
    t = str(args.threads)
    notes: list[str] = []
    details: dict = {}

    if args.gguf:
        gguf, convert_s = Path(args.gguf).resolve(), None
    else:
        gguf, convert_s = convert(model_dir, peers, python, args.outtype)
    if args.convert_only:
        print(gguf)
        return 0
    details["gguf"] = str(gguf)
    if convert_s is not None:
        details["convert_s"] = round(convert_s, 1)

    bench_t0 = time.perf_counter()

    # Prefill -----------------------------------------------------------------------------------
    prefill: dict[str, float | None] = {str(n): None for n in sorted({*PREFILL_LENS, *prefill_lens})}
    lens = [n for n in prefill_lens if n <= max_pos]
    for n in prefill_lens:
        if n > max_pos:
            notes.append(f"prefill {n} skipped: above max_position_embeddings={max_pos}")
    res = llama_bench(bench_bin, gguf, args.threads,
                      ["-p", ",".join(map(str, lens)), "-n", "0", "-r", str(bench_reps)])
    details["prefill_samples"] = {}
    build = res[0].get("build_commit", "?") if res else "?"
    for e in res:
        if e.get("n_gen", 0) == 0 and e.get("n_prompt", 0) > 0:
            prefill[str(e["n_prompt"])] = round(median_ts(e), 2)
            details["prefill_samples"][str(e["n_prompt"])] = [round(x, 2) for x in e.get("samples_ts", [])]
    log(f"prefill: {prefill}")

    # Single-stream decode ----------------------------------------------------------------------
    res = llama_bench(bench_bin, gguf, args.threads,
                      ["-p", "0", "-n", str(single_new), "-d", str(SINGLE_DEPTH), "-r", str(bench_reps)])
    gen = [e for e in res if e.get("n_gen", 0) == single_new]
    if len(gen) != 1:
        raise RuntimeError(f"unexpected llama-bench decode output: {res}")
    decode_single = round(median_ts(gen[0]), 2)
    details["decode_single_samples"] = [round(x, 2) for x in gen[0].get("samples_ts", [])]
    log(f"decode single: {decode_single}")

    # Batched decode ----------------------------------------------------------------------------
    ctx = max(8192, max(batch_sizes) * (BATCH_PROMPT_LEN + batch_new))
    per_b: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for i in range(batched_runs):
        # One retry: a run has now and then printed no row for its largest batch (seen once, on
        # stories260K's Q8_0 in the AVX2 build), which would end a 30-minute alternating run.
        for attempt in range(2):
            text = run_cmd([str(batched_bin), "-m", str(gguf), "-t", t, "-tb", t, "-c", str(ctx),
                            "-npp", str(BATCH_PROMPT_LEN), "-ntg", str(batch_new),
                            "-npl", ",".join(map(str, batch_sizes)), "--output-format", "jsonl"])
            rows = parse_batched_bench(text)
            missing = [b for b in batch_sizes if b not in rows]
            if not missing:
                break
            if attempt == 1:
                raise RuntimeError(f"llama-batched-bench printed no row for batch {missing}:\n" + text[-2000:])
            log(f"no row for batch {missing}; running it again")
        for b in batch_sizes:
            per_b[b].append(round(rows[b]["speed_tg"], 2))
        log(f"batched run {i + 1}/{batched_runs}: " + ", ".join(f"B={b}: {rows[b]['speed_tg']:.1f}" for b in batch_sizes))
    decode_batch: dict[str, float | None] = {str(b): None for b in sorted({*BATCH_SIZES, *batch_sizes})}
    for b in batch_sizes:
        decode_batch[str(b)] = round(statistics.median(per_b[b]), 2)
    details["decode_batch_runs"] = {str(b): v for b, v in per_b.items()}

    bench_s = time.perf_counter() - bench_t0
    weights = gguf.name if args.gguf else args.outtype
    load = os.getloadavg()
    from_sdist = (peers / "llama.cpp" / ".from-sdist")
    src = from_sdist.read_text().strip() if from_sdist.exists() else "?"
    notes[:0] = [
        f"llama.cpp {'' if build in ('unknown', '?') else f'build {build} '}vendored in {src}, {weights} weights, f16 KV cache, {args.threads} threads",
        f"prefill/single decode: median of llama-bench's {bench_reps} repetition(s); "
        f"batched: median of {batched_runs} llama-batched-bench run(s), S_TG (decode only), -c {ctx}",
        f"bench wall {bench_s:.0f}s (excl. conversion); loadavg at end {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}",
    ]
    if args.quick:
        notes.append(f"QUICK MODE: single decode {single_new} tokens, batch decode {batch_new} tokens; "
                     "not comparable with full runs")

    result = {
        "engine": "llama.cpp",
        "model": model_dir.name if model_dir else gguf.stem,
        "weights": weights,
        "build": args.build,
        "prefill_tok_s": prefill,
        "decode_single_tok_s": decode_single,
        "decode_batch_tok_s": decode_batch,
        "notes": "; ".join(notes),
        "details": {**details, "load1_before_after": LOAD_LOG, "bench_wall_s": round(bench_s, 1), "quick": args.quick},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out} (bench wall {bench_s:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
