"""Deterministic benchmark prompts, shared by the peer benches and mirrored by the Rust side.

PROMPT RULE (keep the Rust bench in lockstep with this):
    For a prompt of length n, batch element b (b = 0 for single-stream runs and prefill), and
    position i in 0..n:
        ids[i] = 3 + ((i * 7919 + 13 + b * 104729) % (vocab - 3))
    with vocab = config.json's vocab_size. Ids 0, 1, 2 (unk, bos, eos in the Llama tokenizers used
    here) never appear, and no BOS is prepended. Computed in 64-bit integers (no overflow for any
    realistic n, b, vocab).

Rust:
    fn prompt_ids(n: usize, b: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|i| (3 + (i * 7919 + 13 + b * 104729) % (vocab - 3)) as u32).collect()
    }
"""

from __future__ import annotations


def prompt_ids(n: int, vocab: int, b: int = 0) -> list[int]:
    """Token ids of benchmark prompt `b` of length `n` for a model with `vocab` tokens."""
    if vocab <= 3:
        raise ValueError(f"vocab must be > 3, got {vocab}")
    return [3 + ((i * 7919 + 13 + b * 104729) % (vocab - 3)) for i in range(n)]


def batch_prompt_ids(batch: int, n: int, vocab: int) -> list[list[int]]:
    """`batch` prompts of length `n`; element b uses offset b * 104729."""
    return [prompt_ids(n, vocab, b) for b in range(batch)]


if __name__ == "__main__":
    # Golden values for the Rust test to compare against.
    print("n=8 vocab=512 b=0:", prompt_ids(8, 512))
    print("n=8 vocab=512 b=1:", prompt_ids(8, 512, 1))
    print("n=8 vocab=49152 b=0:", prompt_ids(8, 49152))
    print("n=8 vocab=49152 b=63:", prompt_ids(8, 49152, 63))
