#!/usr/bin/env python3
"""Writes arch_refs.json: what transformers computes for tiny random models of each Llama-family
variant the engine supports. engine/tests/architectures.rs checks the engine against it.

Each variant is a random-model ModelSpec. Its model is written by random-model's `write_model`
example (the writer `fission make-random-model --spec-json` calls, and the same code the Rust test
calls), so the test regenerates bit-identical weights from the spec recorded here. The recorded fingerprint (FNV-1a 64 over
config.json then model.safetensors) tells the test when the writer has drifted from the references.
No weights are committed.

For each of two fixed prompts (id lists, so no tokenizer is involved) the file records the greedy
continuation (16 tokens, no stop token) and the top-5 logits at the last prompt position. Variants
with sliding windows get a third prompt and 24 tokens each (`max_new_tokens` in their entry), their
windows of 7-10 tokens well inside every prompt plus its continuation. transformers
runs in float32 with eager attention, recomputing the full sequence at every step.

Run from the repository root:

    cargo build --release -p random-model --example write_model
    .peers/venv/bin/python engine/tests/reference/make_refs.py

`--only NAME` (repeatable) recomputes the named variants and keeps every other variant's entry
as the existing file has it, byte for byte: a new variant does not re-derive the old ones on
another CPU or library version. A variant computed under versions other than the file's header
records its own `transformers_version` and `torch_version`.
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

MAX_NEW_TOKENS = 16
# Sliding-window variants: more tokens past the window, and a third prompt.
LONG_NEW_TOKENS = 24
# Steps whose top-1 and top-2 logits are closer than this are near-ties: float noise between two
# correct implementations could flip them, so the references refuse them (pick another seed).
MIN_TOP2_GAP = 1e-3

# A short prompt, and one longer than 64 tokens so that rope scaling with
# original_max_position_embeddings 64 is exercised beyond the original context.
PROMPTS = [
    [1, 5, 9, 13, 100, 200, 300, 400, 17, 33],
    [1] + [(37 * k + 11) % 500 + 3 for k in range(1, 80)],
]
LONG_PROMPTS = PROMPTS + [[1] + [(53 * k + 7) % 505 + 3 for k in range(1, 31)]]

# Weights of std 0.1 on hidden 64..128 keep activations near unit scale, so attention is far from
# uniform and rope, bias or norm mistakes move the logits well beyond the test's 1e-4 tolerance.
BASE = {
    "architecture": "LlamaForCausalLM",
    "hidden": 64,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "ffn": 128,
    "vocab": 512,
    "max_pos": 256,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_layout": "top_level",
    "attention_bias": False,
    "tie_word_embeddings": True,
    "sliding_window": None,
    "query_pre_attn_scalar": None,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "sliding_window_pattern": None,
    "rope_local_base_freq": None,
    "partial_rotary_factor": None,
    "original_max_position_embeddings": None,
    "dtype": "float32",
    "init_std": 0.1,
    "seed": 0,
}


def variant(name, description, long=False, rope_rule=None, suite=None, **changes):
    spec = dict(BASE)
    for key in changes:
        # `moe` is not in BASE, so the dense variants' recorded specs stay as they were.
        assert key in spec or key == "moe", f"unknown spec field {key}"
    spec.update(changes)
    v = {"name": name, "description": description, "spec": spec}
    if suite:
        # Checked by engine/tests/architectures_<suite>.rs rather than architectures.rs.
        v["suite"] = suite
    if long:
        v["max_new_tokens"] = LONG_NEW_TOKENS
    if rope_rule:
        v["rope_rule"] = rope_rule
    return v


# LongRoPE factors for rotary_dim 12 (head_dim 16 x 0.75): distinct per frequency, so a factor
# applied to the wrong frequency, or the wrong set, moves the logits.
PHI4_SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
PHI4_LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]


VARIANTS = [
    variant(
        "head_dim_override",
        "Llama, hidden 64 over 4 heads of head_dim 32 (not hidden / heads)",
        head_dim=32,
        seed=101,
    ),
    variant(
        "llama3_rope_scaling",
        "Llama, rope_scaling llama3 (factor 8, low 1, high 4, original 64) with max_pos 256: "
        "head_dim 16 has high, medium and low frequency bands",
        layers=3,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        seed=102,
    ),
    variant(
        "linear_rope_scaling",
        "Llama, rope_scaling linear factor 2",
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        seed=103,
    ),
    variant(
        "qwen2_bias_untied",
        "Qwen2: q/k/v biases (implied by the architecture, not in config.json), own lm_head",
        architecture="Qwen2ForCausalLM",
        attention_bias=True,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        seed=104,
    ),
    variant(
        "mistral",
        "Mistral with sliding_window 4096, larger than the context",
        architecture="MistralForCausalLM",
        sliding_window=4096,
        seed=105,
    ),
    variant(
        "rope_parameters",
        "transformers 5 config: rope_parameters {rope_type default, rope_theta 50000}, "
        "no top-level rope_theta",
        rope_layout="rope_parameters",
        rope_theta=50000.0,
        seed=106,
    ),
    variant(
        "gqa_kv1",
        "Llama, hidden 128, 8 query heads sharing 1 KV head",
        hidden=128,
        heads=8,
        kv_heads=1,
        ffn=256,
        seed=107,
    ),
    variant(
        "rope_parameters_llama3",
        "transformers 5 config with llama3 scaling inside rope_parameters "
        "(theta 500000, factor 4, original 64)",
        rope_layout="rope_parameters",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        seed=108,
    ),
    variant(
        "qwen3",
        "Qwen3 (dense): per-head RMSNorm on q and k (weights 1 + N(0, 0.3)) before rope, no "
        "q/k/v biases, head_dim 32 apart from hidden / heads, own lm_head, theta 1e6",
        architecture="Qwen3ForCausalLM",
        head_dim=32,
        layers=3,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        seed=113,
    ),
    variant(
        "mistral_window",
        "Mistral with sliding_window 7: every layer's queries see their last 7 keys, and every "
        "prompt and continuation goes past it",
        long=True,
        architecture="MistralForCausalLM",
        sliding_window=7,
        init_std=0.25,
        seed=123,
    ),
    variant(
        "gemma2",
        "Gemma 2: sqrt(hidden)-scaled embeddings, (1 + w) norms before and after attention and "
        "MLP, tanh-GELU, query_pre_attn_scalar 24 (not head_dim 32), attention soft-cap 2 and "
        "final soft-cap 5 (small, so they shape the result), layers sliding (window 8), full, "
        "sliding; own lm_head (tied, the scaled embeddings of random weights make every step "
        "repeat the last token)",
        long=True,
        architecture="Gemma2ForCausalLM",
        tie_word_embeddings=False,
        head_dim=32,
        layers=3,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        init_std=0.25,
        seed=131,
    ),
    variant(
        "gemma3",
        "Gemma 3 text: Gemma 2's layer with (1 + w) q/k norms, no soft-caps, "
        "sliding_window_pattern 3 (sliding, sliding, full, sliding; window 10), global rope base "
        "1e6 and local 1e4, one KV head, query_pre_attn_scalar 32, own lm_head",
        long=True,
        architecture="Gemma3ForCausalLM",
        tie_word_embeddings=False,
        layers=4,
        kv_heads=1,
        sliding_window=10,
        sliding_window_pattern=3,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        query_pre_attn_scalar=32,
        init_std=0.25,
        seed=122,
    ),
    variant(
        "phi3",
        "Phi-3: q/k/v fused in self_attn.qkv_proj and gate/up in mlp.gate_up_proj, full "
        "rotary, no rope scaling, sliding_window 9 on every layer (Phi-3-mini's config has "
        "2047, and transformers applies it), own lm_head",
        long=True,
        architecture="Phi3ForCausalLM",
        tie_word_embeddings=False,
        sliding_window=9,
        init_std=0.25,
        seed=141,
    ),
    variant(
        "phi4_mini",
        "Phi-4-mini: fused projections, partial_rotary_factor 0.75 (rope on 12 of 16 dims), "
        "LongRoPE with short and long factors, original context 128 of max_pos 512 (attention "
        "factor sqrt(1 + ln 4 / ln 128) on cos and sin), tied embeddings; every sequence stays "
        "within the original context, where the engine is transformers exactly",
        architecture="Phi3ForCausalLM",
        max_pos=512,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_scaling={"type": "longrope", "short_factor": PHI4_SHORT, "long_factor": PHI4_LONG},
        init_std=0.2,
        seed=142,
    ),
    variant(
        "phi4_mini_long",
        "phi4_mini's shape with original context 20 of max_pos 256: every prompt and "
        "continuation goes past it. transformers takes the long factors for a whole sequence "
        "once it is longer (generate recomputes it); the engine takes them per position "
        "(p + 1 > 20), so these references are transformers' model with its rotary embedding "
        "computed by that rule (rope_rule position); transformers_output_ids are its own",
        long=True,
        rope_rule="position",
        architecture="Phi3ForCausalLM",
        partial_rotary_factor=0.75,
        original_max_position_embeddings=20,
        rope_scaling={"type": "longrope", "short_factor": PHI4_SHORT, "long_factor": PHI4_LONG},
        init_std=0.2,
        seed=143,
    ),
]

# Mixtures of experts (suite "moe", engine/tests/architectures_moe.rs). Router weights of std 0.5
# over hidden 64 give router logits of std ~4: tokens pick different experts, and not by a hair.
MOE_VARIANTS = [
    variant(
        "mixtral",
        "Mixtral: 8 experts of ffn 64 in every layer, top-2 of the softmax renormalised, "
        "router std 0.5 (different tokens pick different experts), own lm_head",
        suite="moe",
        architecture="MixtralForCausalLM",
        ffn=64,
        tie_word_embeddings=False,
        init_std=0.15,
        moe={"experts": 8, "top_k": 2, "norm_topk_prob": True, "router_std": 0.5},
        seed=151,
    ),
    variant(
        "qwen3_moe",
        "Qwen3-MoE: Qwen3's q/k norms and head_dim 32, 6 experts of moe_intermediate_size 32, "
        "top-3 not renormalised (norm_topk_prob false), layer 1 dense (mlp_only_layers [1], "
        "intermediate_size 128), own lm_head",
        suite="moe",
        architecture="Qwen3MoeForCausalLM",
        layers=3,
        head_dim=32,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        init_std=0.15,
        moe={"experts": 6, "top_k": 3, "expert_ffn": 32, "norm_topk_prob": False,
             "mlp_only_layers": [1], "router_std": 0.5},
        seed=152,
    ),
    variant(
        "qwen3_moe_norm",
        "Qwen3-MoE: 8 experts of 48, top-4 renormalised (norm_topk_prob true), "
        "decoder_sparse_step 2 (layers 1 and 3 sparse, 0 and 2 dense), tied embeddings",
        suite="moe",
        architecture="Qwen3MoeForCausalLM",
        layers=4,
        init_std=0.15,
        moe={"experts": 8, "top_k": 4, "expert_ffn": 48, "norm_topk_prob": True,
             "decoder_sparse_step": 2, "router_std": 0.5},
        seed=154,
    ),
]
VARIANTS += MOE_VARIANTS


def use_position_rope_rule(model):
    """Replaces the model's rotary embedding with the engine's LongRoPE rule: position p takes
    the long factors when p + 1 > original_max_position_embeddings, the short ones otherwise
    (transformers takes one set per forward from max(position_ids) + 1). The frequencies and
    the attention factor are transformers' own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = model.model.rotary_emb
    config = rotary.config
    original = config.rope_parameters["original_max_position_embeddings"]
    short = rotary.original_inv_freq.clone()
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original + 1)
    scaling = rotary.attention_scaling

    def forward(x, position_ids):
        pos = position_ids[..., None].float()
        is_long = (position_ids[..., None] + 1) > original
        freqs = torch.where(is_long, pos * long, pos * short)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    rotary.forward = forward


def fingerprint(model_dir):
    """FNV-1a 64 over config.json then model.safetensors, as testkit::random_model::fingerprint."""
    h = 0xCBF29CE484222325
    for name in ["config.json", "model.safetensors"]:
        for b in (model_dir / name).read_bytes():
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def write_model(writer, spec, out, tokenizer_from):
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    subprocess.run([writer, str(spec_path), str(out), str(tokenizer_from)], check=True)


def load(model_dir, spec):
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    # A missing tensor would be silently random-initialized: refuse it.
    for kind in ["missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"]:
        assert not info.get(kind), f"{model_dir}: {kind} {info[kind]}"
    assert type(model).__name__ == spec["architecture"], type(model).__name__
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == spec["tie_word_embeddings"], f"{model_dir}: tied {tied}"
    return model.eval()


@torch.no_grad()
def reference(model, input_ids, max_new_tokens):
    ids = list(input_ids)
    out, top5, gaps = [], None, []
    for step in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        values, indices = torch.topk(logits, 5)
        gaps.append(float(values[0] - values[1]))
        if step == 0:
            top5 = [{"id": int(i), "logit": float(v)} for v, i in zip(values, indices)]
        nxt = int(indices[0])
        out.append(nxt)
        ids.append(nxt)
    return {
        "input_ids": list(input_ids),
        "output_ids": out,
        "first_position_top5": top5,
        "min_top2_gap": min(gaps),
    }


def main():
    root = Path(__file__).resolve().parents[3]
    shared = Path(os.environ.get("FISSION_SHARED_DIR", root.parent / "shared"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writer", default=str(root / "target/release/examples/write_model"))
    ap.add_argument("--tokenizer-from", default=str(shared / "models/stories260K"))
    ap.add_argument("--out", default=str(Path(__file__).with_name("arch_refs.json")))
    ap.add_argument("--only", action="append", default=[],
                    help="recompute only this variant (repeatable); keep the others as --out has them")
    args = ap.parse_args()
    names = [v["name"] for v in VARIANTS]
    for name in args.only:
        if name not in names:
            sys.exit(f"--only {name}: no such variant (have {', '.join(names)})")
    kept, header = {}, {}
    if args.only:
        old = json.loads(Path(args.out).read_text())
        kept = {v["name"]: v for v in old["variants"] if v["name"] not in args.only}
        header = {k: old[k] for k in ["transformers_version", "torch_version"]}
    if not Path(args.writer).is_file():
        sys.exit(f"{args.writer} not found: run "
                 "`cargo build --release -p random-model --example write_model` first")
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    variants = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            if args.only and v["name"] not in args.only:
                if v["name"] in kept:
                    variants.append(kept[v["name"]])
                    continue
                sys.exit(f"{v['name']} is not in {args.out}: add it with --only {v['name']}")
            model_dir = Path(tmp) / v["name"]
            write_model(args.writer, v["spec"], model_dir, args.tokenizer_from)
            model = load(model_dir, v["spec"])
            prompts = LONG_PROMPTS if "max_new_tokens" in v else PROMPTS
            new_tokens = v.get("max_new_tokens", MAX_NEW_TOKENS)
            own = None
            if v.get("rope_rule") == "position":
                own = [reference(model, p, new_tokens)["output_ids"] for p in prompts]
                use_position_rope_rule(model)
            refs = [reference(model, p, new_tokens) for p in prompts]
            if own is not None:
                for r, o in zip(refs, own):
                    r["transformers_output_ids"] = o
            for i, r in enumerate(refs):
                if r["min_top2_gap"] < MIN_TOP2_GAP:
                    sys.exit(f"{v['name']} prompt {i}: near-tie (top-2 gap {r['min_top2_gap']:.2e}); "
                             "change its seed")
                assert all(math.isfinite(t["logit"]) for t in r["first_position_top5"])
            entry = {**v, "fingerprint": fingerprint(model_dir), "references": refs}
            versions = {"transformers_version": transformers.__version__,
                        "torch_version": torch.__version__}
            if header and versions != header:
                entry.update(versions)
            variants.append(entry)
            print(f"{v['name']}: {[r['output_ids'][:6] for r in refs]} "
                  f"min gap {min(r['min_top2_gap'] for r in refs):.3f}", file=sys.stderr)

    doc = {
        "about": "Generated by engine/tests/reference/make_refs.py; checked by "
                 "engine/tests/architectures.rs. Greedy (argmax) decoding without stop tokens, "
                 "float32, eager attention, CPU. output_ids are the new tokens only; "
                 "first_position_top5 are raw logits at the last prompt position.",
        "transformers_version": header.get("transformers_version", transformers.__version__),
        "torch_version": header.get("torch_version", torch.__version__),
        "max_new_tokens": MAX_NEW_TOKENS,
        "variants": variants,
    }
    text = json.dumps(doc, indent=1)
    # One line per id list and per top-5 entry keeps the file reviewable.
    text = re.sub(r"\[\s+([-0-9.,e\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    text = re.sub(r"\{\s+(\"id\": \d+),\s+(\"logit\": [-0-9.e]+)\s+\}", r"{\1, \2}", text)
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
