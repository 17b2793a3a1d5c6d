"""Turns the engine bench JSONs of one run into BENCHMARKS.md's table (tokens/s, ratios)."""
import json
import pathlib
import sys

run = pathlib.Path(sys.argv[1])
rows = [("prefill 128", ("prefill_tok_s", "128")), ("prefill 512", ("prefill_tok_s", "512")),
        ("prefill 2048", ("prefill_tok_s", "2048")), ("decode single stream", ("decode_single_tok_s", None)),
        ("decode batch 1", ("decode_batch_tok_s", "1")), ("decode batch 8", ("decode_batch_tok_s", "8")),
        ("decode batch 32", ("decode_batch_tok_s", "32")), ("decode batch 64", ("decode_batch_tok_s", "64"))]


def get(d, key):
    if d is None:
        return None
    v = d.get(key[0])
    return v.get(key[1]) if key[1] is not None and isinstance(v, dict) else v


def fmt(x):
    return "n/a" if x is None else f"{x:,.1f}"


def ratio(a, b):
    return "n/a" if a is None or b in (None, 0) else f"{a / b:.2f}x"


for f in sorted(run.glob("fission-*.json")):
    model = f.stem[len("fission-"):]
    load = lambda e: json.loads((run / f"{e}-{model}.json").read_text()) if (run / f"{e}-{model}.json").exists() else None
    fi, tf, lc = load("fission"), load("transformers"), load("llamacpp")
    print(f"\n### {model} (tokens/s, f32, 2 threads)\n")
    print("| measurement | Fission | transformers | llama.cpp | Fission / transformers | Fission / llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, key in rows:
        a, b, c = get(fi, key), get(tf, key), get(lc, key)
        print(f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(c)} | {ratio(a, b)} | {ratio(a, c)} |")
