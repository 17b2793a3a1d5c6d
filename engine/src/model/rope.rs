//! Rotary position embeddings, computed exactly as transformers does (f32 inverse frequencies,
//! f32 angles, rotate-half layout) so greedy tokens match the reference.
//!
//! With a partial rotary factor (Phi-4-mini) only the first `rotary_dim` dims of each head
//! rotate, rotate-half among themselves (dim `i` with `i + rotary_dim / 2`); the rest pass
//! through, as transformers' `apply_rotary_pos_emb` splits `q[..., :rotary_dim]`.
//!
//! LongRoPE (Phi-3) divides each frequency by a short factor within
//! `original_max_position_embeddings` and by a long factor beyond it. transformers picks one
//! set for a whole forward from `max(position_ids) + 1`, and `Phi3ForCausalLM`'s `generate`
//! drops its cache and recomputes the whole sequence with the long set at the step the
//! sequence first grows past the original context. A paged cache whose blocks are shared
//! (prefix cache), pushed (prefill/decode split) and computed in chunks of any size cannot
//! recompute them per sequence. Here the position decides instead: position `p` takes the
//! long set when `p + 1 > original` (its sequence, if it ended there, would be long in
//! transformers), the short one otherwise. So a block's KV depends only on its tokens, and
//! every sequence that stays within the original context is transformers' exactly; one that
//! goes past it keeps its earlier positions' short rotation where transformers would redo
//! them long (`engine/tests/architectures.rs` checks both: against transformers within the
//! context, and past it against transformers' layers run with this position rule).

use crate::config::{ModelConfig, RopeScaling};

/// Inverse frequencies for the rotary part of one head, with the configured scaling applied.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    /// LongRoPE: the positions from which `long_inv_freq` applies, and those frequencies.
    long: Option<(usize, Vec<f32>)>,
    /// Multiplies cos and sin (LongRoPE's attention factor; 1 otherwise).
    attention_factor: f32,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::with_base(cfg.rotary_dim, cfg.rope_theta, &cfg.rope_scaling)
    }

    /// The sliding layers' own rope, unscaled, when the model has one (Gemma 3's
    /// `rope_local_base_freq`).
    pub fn local(cfg: &ModelConfig) -> Option<Self> {
        cfg.local_rope_theta
            .map(|theta| Self::with_base(cfg.rotary_dim, theta, &RopeScaling::None))
    }

    fn with_base(dim: usize, theta: f64, scaling: &RopeScaling) -> Self {
        let base = theta as f32;
        let exponents = || (0..dim).step_by(2).map(|i| i as f32 / dim as f32);
        let mut inv_freq: Vec<f32> = exponents().map(|e| 1.0 / base.powf(e)).collect();
        let (mut long, mut attention_factor) = (None, 1.0);
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= *factor as f32;
                }
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor: a,
            } => {
                // transformers' _compute_longrope_parameters: 1 / (ext * base^(i / dim)).
                let scaled = |ext: &[f64]| -> Vec<f32> {
                    exponents()
                        .zip(ext)
                        .map(|(e, &x)| 1.0 / (x as f32 * base.powf(e)))
                        .collect()
                };
                inv_freq = scaled(short_factor);
                long = Some((*original_max_position_embeddings, scaled(long_factor)));
                attention_factor = *a as f32;
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                // transformers' _compute_llama3_parameters.
                let old = *original_max_position_embeddings as f32;
                let (factor, low, high) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let smooth = (old / wavelen - low) / (high - low);
                    let is_medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *f = if is_medium {
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        Rope {
            inv_freq,
            long,
            attention_factor,
        }
    }

    pub fn half_dim(&self) -> usize {
        self.inv_freq.len()
    }

    /// cos and sin tables `[positions.len(), rotary_dim / 2]`, computed once per forward and
    /// shared by every layer.
    pub fn tables(&self, positions: &[u32]) -> RopeTables {
        let h = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * h);
        let mut sin = Vec::with_capacity(positions.len() * h);
        let a = self.attention_factor;
        for &p in positions {
            let inv_freq = match &self.long {
                Some((original, long)) if p as usize + 1 > *original => long,
                _ => &self.inv_freq,
            };
            for &f in inv_freq {
                let angle = f * p as f32;
                // transformers: emb.cos() * attention_scaling, in f32 (exact when it is 1).
                cos.push(angle.cos() * a);
                sin.push(angle.sin() * a);
            }
        }
        RopeTables {
            cos,
            sin,
            half_dim: h,
        }
    }
}

/// Per-token cos/sin rows for one forward pass.
pub struct RopeTables {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half_dim: usize,
}

impl RopeTables {
    /// Rotates one head vector in place (rotate_half: pairs i and i + r/2 for the rotary dims
    /// r = 2 * half_dim; any dims past them are left as they are).
    #[inline]
    pub fn apply(&self, token: usize, x: &mut [f32]) {
        let h = self.half_dim;
        let cos = &self.cos[token * h..(token + 1) * h];
        let sin = &self.sin[token * h..(token + 1) * h];
        let (a, b) = x.split_at_mut(h);
        for i in 0..h {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn longrope(original: usize) -> Rope {
        Rope::with_base(
            4,
            10_000.0,
            &RopeScaling::LongRope {
                short_factor: vec![1.0, 2.0],
                long_factor: vec![3.0, 5.0],
                original_max_position_embeddings: original,
                attention_factor: 1.5,
            },
        )
    }

    /// Frequencies are 1 / (factor * base^(i / rotary_dim)); position p takes the long set
    /// once p + 1 > original; cos and sin carry the attention factor.
    #[test]
    fn longrope_takes_the_long_factors_from_the_original_context_on() {
        let rope = longrope(8);
        let t = rope.tables(&[3, 7, 8, 20]);
        let angle = |p: f32, factor: f32, i: usize| p / (factor * 10_000f32.powf(i as f32 / 4.0));
        let want = [
            (3.0, [1.0, 2.0]),
            (7.0, [1.0, 2.0]),
            (8.0, [3.0, 5.0]),
            (20.0, [3.0, 5.0]),
        ];
        for (row, (p, factors)) in want.iter().enumerate() {
            for (j, &f) in factors.iter().enumerate() {
                let a = angle(*p, f, 2 * j);
                assert!(
                    (t.cos[row * 2 + j] - a.cos() * 1.5).abs() < 1e-6,
                    "row {row}"
                );
                assert!(
                    (t.sin[row * 2 + j] - a.sin() * 1.5).abs() < 1e-6,
                    "row {row}"
                );
            }
        }
    }

    /// With 4 rotary dims of a 6-dim head, dims 0..4 rotate in pairs (0, 2) and (1, 3), and
    /// dims 4 and 5 pass through.
    #[test]
    fn partial_rotary_rotates_the_leading_dims_only() {
        let rope = Rope::with_base(4, 10_000.0, &RopeScaling::None);
        let t = rope.tables(&[5]);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        t.apply(0, &mut x);
        let (c0, s0) = (5f32.cos(), 5f32.sin());
        assert!((x[0] - (1.0 * c0 - 3.0 * s0)).abs() < 1e-6);
        assert!((x[2] - (3.0 * c0 + 1.0 * s0)).abs() < 1e-6);
        assert_eq!(&x[4..], &[5.0, 6.0]);
    }
}
