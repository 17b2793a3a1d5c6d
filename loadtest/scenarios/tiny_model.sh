# Sourced by the scenarios: `tiny_model FISSION DIR` writes the tiny random model the load
# generator's `<extra_N>` prompts need (2 layers, SmolLM2's padded 49k vocab, stories260K's
# tokenizer) to DIR unless it is there already.
tiny_model() {
  local fission=$1 dir=$2 spec
  [ -f "$dir/model.safetensors" ] && return 0
  spec=$(mktemp)
  cat > "$spec" <<'JSON'
{"architecture":"LlamaForCausalLM","hidden":64,"layers":2,"heads":4,"kv_heads":2,"head_dim":16,"ffn":128,
 "vocab":49152,"max_pos":2048,"rope_theta":10000.0,"rope_scaling":null,"rope_layout":"top_level",
 "attention_bias":false,"tie_word_embeddings":true,"sliding_window":null,"dtype":"float32",
 "init_std":0.02,"seed":0}
JSON
  "$fission" make-random-model --spec-json "$spec" --out "$dir" --tokenizer-from ../shared/models/stories260K
}
