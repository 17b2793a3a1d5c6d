#!/usr/bin/env python3
"""Writes a random-weight HF LlamaForCausalLM directory in SmolLM2-135M's shape.

Usage:
    .peers/venv/bin/python engine/benches/peers/make_random_model.py --out .models/smollm2-135m-random \
        [--seed 0] [--tokenizer-from /work/shared/models/stories260K] [--force]

Shape: hidden 576, 30 layers, 9 query / 3 KV heads, head_dim 64, FFN 1536, vocab 49152, tied
embeddings, rope_theta 100000, rms_norm_eps 1e-5, max_position_embeddings 8192, float32
(134.5M parameters, 538 MB).

Weights: every matrix (embeddings, q/k/v/o, gate/up/down) ~ N(0, 0.02^2), drawn in the order the
tensors are listed below from torch.Generator seeded with --seed; RMSNorm weights are 1. No
lm_head.weight is stored (tied to model.embed_tokens.weight).

Tokenizer: stories260K's tokenizer.json (a 512-token byte-fallback BPE) with added tokens
"<extra_ID>" for ID in 512..vocab-1, so that every id in the model's vocab decodes.
tokenizer_config.json is copied with those added tokens listed in added_tokens_decoder.
No tokenizer.model is written: with it, convert_hf_to_gguf.py would take the sentencepiece path and
pad the vocab with its own [PAD] tokens; without it, it reads tokenizer.json (LlamaHfVocab), which
keeps the <extra_ID> tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HIDDEN = 576
LAYERS = 30
HEADS = 9
KV_HEADS = 3
HEAD_DIM = 64
FFN = 1536
VOCAB = 49152
MAX_POS = 8192
STD = 0.02

DEFAULT_TOKENIZER_FROM = "/work/shared/models/stories260K"


def config_json() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        # Both spellings: transformers <5 reads rope_theta, 5.x writes rope_parameters.
        "rope_theta": 100000.0,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": STD,
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def tensor_shapes() -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        shapes += [
            (f"{p}.input_layernorm.weight", (HIDDEN,)),
            (f"{p}.self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
            (f"{p}.self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (f"{p}.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
            (f"{p}.mlp.gate_proj.weight", (FFN, HIDDEN)),
            (f"{p}.mlp.up_proj.weight", (FFN, HIDDEN)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN, FFN)),
        ]
    shapes.append(("model.norm.weight", (HIDDEN,)))
    return shapes


def write_weights(out: Path, seed: int) -> int:
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in tensor_shapes():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.empty(shape, dtype=torch.float32)
            t.normal_(mean=0.0, std=STD, generator=gen)
            tensors[name] = t
    n_params = sum(t.numel() for t in tensors.values())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return n_params


def write_tokenizer(out: Path, src: Path) -> None:
    tok = json.loads((src / "tokenizer.json").read_text())
    base = len(tok["model"]["vocab"])
    taken = {t["id"] for t in tok["added_tokens"]}
    for i in range(base, VOCAB):
        if i in taken:
            continue
        tok["added_tokens"].append({
            "id": i, "content": f"<extra_{i}>", "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False,
        })
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))

    cfg = json.loads((src / "tokenizer_config.json").read_text())
    dec = cfg.setdefault("added_tokens_decoder", {})
    for t in tok["added_tokens"]:
        dec.setdefault(str(t["id"]), {
            "content": t["content"], "lstrip": t["lstrip"], "normalized": t["normalized"],
            "rstrip": t["rstrip"], "single_word": t["single_word"], "special": t["special"],
        })
    cfg["model_max_length"] = MAX_POS
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    for extra in ("special_tokens_map.json",):
        if (src / extra).exists():
            shutil.copyfile(src / extra, out / extra)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", default=DEFAULT_TOKENIZER_FROM,
                    help="directory with a Llama tokenizer.json + tokenizer_config.json to extend")
    ap.add_argument("--force", action="store_true", help="overwrite an existing model")
    args = ap.parse_args()

    out = Path(args.out)
    if (out / "model.safetensors").exists() and not args.force:
        print(f"{out} already has model.safetensors; pass --force to rewrite", file=sys.stderr)
        return 0
    out.mkdir(parents=True, exist_ok=True)

    (out / "config.json").write_text(json.dumps(config_json(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n")
    write_tokenizer(out, Path(args.tokenizer_from))
    n_params = write_weights(out, args.seed)
    (out / "SOURCE.md").write_text(
        "# smollm2-135m-random\n"
        f"Random weights (N(0, {STD}^2), torch.Generator seed {args.seed}, norms = 1) in SmolLM2-135M's shape,\n"
        f"written by engine/benches/peers/make_random_model.py. {n_params:,} parameters, float32.\n"
        f"Tokenizer: {args.tokenizer_from}/tokenizer.json padded with <extra_ID> added tokens to {VOCAB}.\n"
    )
    print(f"wrote {out}: {n_params:,} params ({n_params * 4 / 1e6:.0f} MB f32)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
