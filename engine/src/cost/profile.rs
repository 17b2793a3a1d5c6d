//! Built-in cost profiles, shipped as JSON under `engine/profiles/` and compiled in so
//! `--profile h100-llama8b` works from any directory. Each file's `sources` says where every
//! figure comes from; the tests below re-derive the figures that follow from others.

/// Names `--profile` takes besides a path.
pub const BUILTIN: [&str; 1] = ["h100-llama8b"];

/// The JSON text of a built-in profile.
pub fn builtin(name: &str) -> Option<&'static str> {
    match name {
        "h100-llama8b" => Some(include_str!("../../profiles/h100-llama8b.json")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use crate::cost::{CostModel, StepCost, StepWork};

    fn h100() -> CostModel {
        CostModel::load("h100-llama8b").expect("the built-in profile parses")
    }

    fn close(got: f64, want: f64, rel: f64) -> bool {
        (got - want).abs() <= rel * want.abs()
    }

    #[test]
    fn llama3_8b_shape_gives_its_parameters_and_kv_bytes() {
        let m = h100().model;
        // Meta's model card: 8.03B parameters.
        assert!(close(m.num_params(), 8.03e9, 0.001), "{}", m.num_params());
        assert_eq!(m.kv_bytes_per_token(), 131_072);
        assert!(close(m.weight_bytes(), 16.06e9, 0.001));
        // Attention in the matmul count: 2 * (8.03e9 - 128256 * 4096) per token.
        assert!(close(m.matmul_params(), 8.03e9 - 525.3e6, 0.001));
    }

    #[test]
    fn decode_at_batch_one_reads_the_weights_at_effective_bandwidth() {
        let p = h100();
        let StepCost::Roofline(r) = p.step else {
            panic!("the H100 profile is a roofline");
        };
        let want = p.model.weight_bytes() / (3.35e12 * 0.75);
        assert_eq!((r.hbm_bytes_per_s, r.bw_efficiency), (3.35e12, 0.75));
        // One sequence of 512 tokens: the weights dominate; the KV adds 67 MB.
        let got = p.decode_s(1, 512);
        assert!(close(got, want, 0.01), "{got} vs {want}");
        assert!(close(got, 6.39e-3, 0.01), "{got}");
    }

    #[test]
    fn prefill_is_compute_bound_at_the_stated_mfu() {
        let p = h100();
        let m = &p.model;
        let n = 2048.0;
        let flops = 2.0 * m.matmul_params() * n + m.attn_flops_per_pair() * n * (n + 1.0) / 2.0;
        let want = flops / (989.4e12 * 0.55);
        let got = p.prefill_s(2048);
        assert!(close(got, want, 1e-9), "{got} vs {want}");
        // About 56 ms, within what 8B prefills of 2K tokens take on an H100.
        assert!((0.045..0.070).contains(&got), "{got}");
        // Short prompts are memory bound: never faster than reading the weights.
        assert!(p.prefill_s(16) >= p.decode_s(1, 0) * 0.999);
        let mixed = StepWork {
            decode_seqs: 64,
            decode_context_tokens: 64 * 1000,
            ..StepWork::prefill(512)
        };
        assert!(p.step_s(&mixed) > p.prefill_s(512));
    }

    #[test]
    fn kv_blocks_and_link_follow_their_sources() {
        let p = h100();
        let usable = 80e9 * 0.9 - p.model.weight_bytes() - 2e9;
        let block_bytes = 16.0 * p.model.kv_bytes_per_token() as f64;
        assert_eq!(p.node.kv_blocks, (usable / block_bytes) as usize);
        assert_eq!(p.link.bandwidth_bytes_per_s, 50e9 * 0.8);
        // 1,536 tokens of KV (201 MB) cross in about 5 ms.
        let s = p.kv_bytes(1536) / p.link.bandwidth_bytes_per_s;
        assert!(close(s, 5.03e-3, 0.01), "{s}");
        for key in [
            "model",
            "step.peak_flops",
            "step.mfu",
            "step.hbm_bytes_per_s",
            "step.bw_efficiency",
            "step.overhead_s",
            "link.bandwidth_bytes_per_s",
            "link.latency_s",
            "node.kv_blocks",
        ] {
            assert!(p.sources.contains_key(key), "no source for {key}");
        }
    }

    #[test]
    fn unknown_profiles_are_refused() {
        assert!(CostModel::load("a100-nothing").is_err());
    }
}
