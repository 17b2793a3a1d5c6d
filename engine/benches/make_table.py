"""Turns one run of run_engine_bench.sh into BENCHMARKS.md's tables.

Per figure: the median over rounds with its min-max spread, for each engine, and the ratio
of medians with the spread of the per-round ratios (rounds ran the engines back to back, so a
per-round ratio cancels the drift between rounds). The limits rows give each target's ceiling.
"""
import json
import pathlib
import re
import statistics
import sys

run = pathlib.Path(sys.argv[1])
ROWS = [("prefill 128", ("prefill_tok_s", "128")), ("prefill 512", ("prefill_tok_s", "512")),
        ("prefill 2048", ("prefill_tok_s", "2048")), ("decode single stream", ("decode_single_tok_s", None)),
        ("decode batch 1", ("decode_batch_tok_s", "1")), ("decode batch 8", ("decode_batch_tok_s", "8")),
        ("decode batch 32", ("decode_batch_tok_s", "32")), ("decode batch 64", ("decode_batch_tok_s", "64"))]
ENGINES = ["fission", "llamacpp", "transformers"]
# int8 weights: Fission's --quantize int8 against llama.cpp's Q8_0 of the same checkpoint.
INT8_ENGINES = ["fission_int8", "llamacpp_q8_0"]


def get(d, key):
    v = d.get(key[0])
    return v.get(key[1]) if key[1] is not None and isinstance(v, dict) else v


def load_rounds(engine, model):
    """round number -> figures."""
    out = {}
    for f in run.glob(f"{engine}-{model}-r*.json"):
        out[int(re.search(r"-r(\d+)\.json$", f.name).group(1))] = json.loads(f.read_text())
    return out


def spread(vals):
    if not vals:
        return "n/a"
    return f"{statistics.median(vals):,.1f} ({min(vals):,.1f}-{max(vals):,.1f})"


def ratio(a_rounds, b_rounds, key):
    a = [get(v, key) for v in a_rounds.values()]
    b = [get(v, key) for v in b_rounds.values()]
    a, b = [x for x in a if x], [x for x in b if x]
    if not a or not b:
        return "n/a"
    per = [get(a_rounds[r], key) / get(b_rounds[r], key) for r in a_rounds
           if r in b_rounds and get(a_rounds[r], key) and get(b_rounds[r], key)]
    rng = f" ({min(per):.2f}-{max(per):.2f})" if per else ""
    return f"**{statistics.median(a) / statistics.median(b):.2f}x**{rng}"


limits = [json.loads(f.read_text()) for f in sorted(run.glob("limits-*.json"))]
isa_file = run / "isa.txt"
if isa_file.exists() and isa_file.read_text().strip() != "native":
    print(f"\nEvery engine capped at {isa_file.read_text().strip()} (run_engine_bench.sh ISA=...).")
# Every model some Fission run measured: f32, int8, or a GGUF file only (the Llama-3.2-1B shape).
FISSION_RUN = re.compile(r"^(?:fission|fission_int8|fission_gguf_q4_k_m|fission_gguf_q8_0)-(.+)-r\d+\.json$")
models = sorted({m.group(1) for f in run.glob("fission*-r*.json") if (m := FISSION_RUN.match(f.name))})
for model in models:
    data = {e: load_rounds(e, model) for e in ENGINES}
    n = len(data["fission"])
    if n:
        print(f"\n### {model} (tokens/s, f32, 2 threads, median of {n} alternating rounds, min-max)\n")
        print("| measurement | Fission | llama.cpp | transformers | Fission / llama.cpp | Fission / transformers |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, key in ROWS:
            cells = [spread([x for x in (get(v, key) for v in data[e].values()) if x]) for e in ENGINES]
            print(f"| {label} | {cells[0]} | {cells[1]} | {cells[2]} | "
                  f"{ratio(data['fission'], data['llamacpp'], key)} | {ratio(data['fission'], data['transformers'], key)} |")
    q = {e: load_rounds(e, model) for e in INT8_ENGINES}
    if q["fission_int8"]:
        print(f"\n### {model}, int8 weights (tokens/s, Fission --quantize int8 vs llama.cpp Q8_0, "
              f"median of {len(q['fission_int8'])} alternating rounds, min-max)\n")
        print("| measurement | Fission int8 | llama.cpp Q8_0 | Fission int8 / llama.cpp Q8_0 | Fission int8 / Fission f32 |")
        print("|---|---:|---:|---:|---:|")
        for label, key in ROWS:
            cells = [spread([x for x in (get(v, key) for v in q[e].values()) if x]) for e in INT8_ENGINES]
            print(f"| {label} | {cells[0]} | {cells[1]} | "
                  f"{ratio(q['fission_int8'], q['llamacpp_q8_0'], key)} | {ratio(q['fission_int8'], data['fission'], key)} |")
    # The GGUF rows (issue 33): Fission on llama.cpp's own Q4_K_M and Q8_0 files, as stored.
    for fis, lla, label in [("fission_gguf_q4_k_m", "llamacpp_q4_k_m", "Q4_K_M"),
                            ("fission_gguf_q8_0", "llamacpp_q8_0", "Q8_0")]:
        g = {e: load_rounds(e, model) for e in (fis, lla)}
        if not g[fis]:
            continue
        print(f"\n### {model}, {label} GGUF (tokens/s, both engines on the same file, "
              f"median of {len(g[fis])} alternating rounds, min-max)\n")
        print(f"| measurement | Fission {label} | llama.cpp {label} | Fission / llama.cpp |")
        print("|---|---:|---:|---:|")
        for row_label, key in ROWS:
            if not any(get(v, key) for e in (fis, lla) for v in g[e].values()):
                continue  # a figure neither engine ran (the 1B rows run three)
            cells = [spread([x for x in (get(v, key) for v in g[e].values()) if x]) for e in (fis, lla)]
            print(f"| {row_label} | {cells[0]} | {cells[1]} | {ratio(g[fis], g[lla], key)} |")
# kl.json: this run's, on SmolLM2's files; kl-llama32-1b.json: measured when the 1B files were made.
kls = [json.loads(f.read_text()) for f in sorted(run.glob("kl*.json"))]
if kls:
    kl = kls[0]
    print(f"\n### Q4_K_M's KL divergence from f32 (engine/tests/kl_llama_cpp.rs: {kl['chunks']} chunks of "
          f"{kl['n_ctx']} tokens of engine/benches/kl_text.txt, the second half of each scored as "
          f"llama-perplexity does, {kl['positions']} positions, against llama.cpp's f32 base)\n")
    print("| file | llama.cpp Q4_K_M | Fission Q4_K_M | Fission / llama.cpp | Fission f32 | Fission's own f32 -> Q4_K_M |")
    print("|---|---:|---:|---:|---:|---:|")
    for kl in kls:
        print(f"| {pathlib.Path(kl['q4_k_m_gguf']).name} | {kl['llama_cpp_q4_k_m_kl']:.4e} | {kl['fission_q4_k_m_kl']:.4e} | "
              f"**{kl['ratio']:.3f}x** | {kl['fission_f32_kl']:.1e} | {kl['fission_own_f32_to_q4_k_m_kl']:.4e} |")
if limits:
    reads = [l["read_gb_s"] for l in limits]
    peaks = [l["gemm_peak_gflops"] for l in limits]
    fmas = [l["fma_peak_gflops"] for l in limits if "fma_peak_gflops" in l]
    fma = f"; FMA peak (registers only) {', '.join(f'{p:.0f}' for p in fmas)} GFLOP/s" if fmas else ""
    print(f"\nCeilings (before and after the rounds): read bandwidth {', '.join(f'{r:.1f}' for r in reads)} GB/s; "
          f"packed GEMM best {', '.join(f'{p:.0f}' for p in peaks)} GFLOP/s{fma}.")
    isas = sorted({l.get("kernel_isa", "?") for l in limits})
    print(f"Fission's kernels: {', '.join(isas)}.")
