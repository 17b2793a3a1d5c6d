//! What each request asks for: its prompt and its input and output lengths.
//!
//! - `fixed`: every request has `input_len` prompt tokens and asks for `output_len` tokens.
//! - `sharegpt`: chat. Lognormal lengths with the means the vLLM paper reports for ShareGPT
//!   (Kwon et al., SOSP 2023, Fig. 11: 161.31 input and 337.99 output tokens on average). The
//!   spreads, σ = 1.0 for inputs and 0.8 for outputs (natural log), are this crate's choice: the
//!   paper gives histograms, not fitted parameters, and these reproduce their shape, a peak of
//!   short turns with a long tail (median = mean / e^(σ²/2): 98 and 245 tokens).
//! - `summarise`: long prompts, short answers, shaped like the LongBench summarisation tasks
//!   DistServe serves (Zhong et al., OSDI 2024). LongBench's English summarisation documents
//!   run to thousands of words, far past the 2,048-token context DistServe's OPT models had,
//!   so the prompts it served were cut near that limit. Means 1,536 input tokens (σ 0.4) and
//!   128 output tokens (σ 0.5) model that; they are assumptions, not a fit to the dataset.
//! - `shared-prefix`: `prefixes` system prompts of `prefix_len` tokens, each shared by `users`
//!   users. A request picks a (system prompt, user) pair; its prompt is the system prompt, the
//!   user's own context (half of `input_len`, the same on every request of that user) and a
//!   fresh question (the other half). It exercises prefix caching and cache-aware routing.
//! - `multi-turn`: chats of [`TURNS`] turns with a growing shared history. Turn `k` of a
//!   conversation is its system prompt (`prefix_len` tokens), then for each earlier turn the
//!   user's message (`input_len`) and the assistant's answer (`output_len`), then the new
//!   message: every turn repeats the conversation so far, as chat APIs resend it. The answers
//!   in the history are seeded stand-ins of `output_len` tokens, not the server's own (the run
//!   stays repeatable and its lengths exact), so what a server can reuse from an earlier turn
//!   is that turn's prompt. Requests go round-robin over `users` conversations: the first
//!   `users` requests are their first turns, the next `users` their second turns, and so on
//!   ([`turn_of`]); in a closed loop of at most `users` clients a turn is sent after the
//!   previous turn of its conversation was.
//!
//! For the lognormal workloads `input_len`/`output_len`, when given, replace the means (σ
//! stays), so the shapes fit small models. Every length is clamped to `[1, max_input_len]` and
//! `[1, max_output_len]`; clamping lowers the means, and the report shows the realised ones.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};
use serde::Serialize;

use crate::error::LoadError;
use crate::prompt::{PromptBuilder, PromptStyle};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    Fixed,
    Sharegpt,
    Summarise,
    SharedPrefix,
    MultiTurn,
}

/// Turns of each `multi-turn` conversation.
pub const TURNS: usize = 4;

/// The conversation and the turn (0 for the first) of request `index` of a `multi-turn`
/// workload of `users` conversations at a time.
pub fn turn_of(index: u64, users: usize) -> (u64, usize) {
    let users = users.max(1) as u64;
    let round = index / users;
    let turn = (round % TURNS as u64) as usize;
    let conversation = round / TURNS as u64 * users + index % users;
    (conversation, turn)
}

/// Lognormal means and spreads (σ of the log) of the built-in shapes; see the module doc.
pub const SHAREGPT_INPUT: LengthShape = LengthShape {
    mean: 161.31,
    sigma: 1.0,
};
pub const SHAREGPT_OUTPUT: LengthShape = LengthShape {
    mean: 337.99,
    sigma: 0.8,
};
pub const SUMMARISE_INPUT: LengthShape = LengthShape {
    mean: 1536.0,
    sigma: 0.4,
};
pub const SUMMARISE_OUTPUT: LengthShape = LengthShape {
    mean: 128.0,
    sigma: 0.5,
};

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LengthShape {
    pub mean: f64,
    pub sigma: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadConfig {
    pub kind: WorkloadKind,
    /// Fixed lengths for `fixed` and `shared-prefix` (default 128 and 32); the means for the
    /// lognormal kinds when given.
    pub input_len: Option<usize>,
    pub output_len: Option<usize>,
    pub max_input_len: usize,
    pub max_output_len: usize,
    pub prefixes: usize,
    pub users: usize,
    pub prefix_len: usize,
    pub prompt_style: PromptStyle,
}

pub const DEFAULT_INPUT_LEN: usize = 128;
pub const DEFAULT_OUTPUT_LEN: usize = 32;

impl WorkloadConfig {
    pub fn fixed(input_len: usize, output_len: usize, prompt_style: PromptStyle) -> Self {
        Self {
            kind: WorkloadKind::Fixed,
            input_len: Some(input_len),
            output_len: Some(output_len),
            max_input_len: 1 << 20,
            max_output_len: 1 << 20,
            prefixes: 4,
            users: 8,
            prefix_len: 256,
            prompt_style,
        }
    }

    /// The input and output length laws this configuration means.
    pub fn lengths(&self) -> Result<(Lengths, Lengths), LoadError> {
        let fixed = |v: Option<usize>, default: usize| Lengths::Fixed(v.unwrap_or(default));
        let shaped = |v: Option<usize>, shape: LengthShape| match v {
            Some(mean) => Lengths::log_normal(LengthShape {
                mean: mean as f64,
                ..shape
            }),
            None => Lengths::log_normal(shape),
        };
        let (input, output) = match self.kind {
            WorkloadKind::Fixed | WorkloadKind::SharedPrefix | WorkloadKind::MultiTurn => (
                fixed(self.input_len, DEFAULT_INPUT_LEN),
                fixed(self.output_len, DEFAULT_OUTPUT_LEN),
            ),
            WorkloadKind::Sharegpt => (
                shaped(self.input_len, SHAREGPT_INPUT)?,
                shaped(self.output_len, SHAREGPT_OUTPUT)?,
            ),
            WorkloadKind::Summarise => (
                shaped(self.input_len, SUMMARISE_INPUT)?,
                shaped(self.output_len, SUMMARISE_OUTPUT)?,
            ),
        };
        if matches!(input, Lengths::Fixed(0)) {
            return Err(LoadError::invalid("input_len", "must be at least 1", 0));
        }
        if matches!(output, Lengths::Fixed(0)) {
            return Err(LoadError::invalid("output_len", "must be at least 1", 0));
        }
        if self.max_input_len == 0 || self.max_output_len == 0 {
            return Err(LoadError::invalid(
                "max_input_len/max_output_len",
                "must be at least 1",
                0,
            ));
        }
        if self.kind == WorkloadKind::MultiTurn && self.users == 0 {
            return Err(LoadError::invalid("users", "must be at least 1", 0));
        }
        if self.kind == WorkloadKind::SharedPrefix && (self.prefixes == 0 || self.users == 0) {
            return Err(LoadError::invalid(
                "prefixes/users",
                "must be at least 1 each",
                format!("{}x{}", self.prefixes, self.users),
            ));
        }
        Ok((input, output))
    }

    pub fn sampler(&self, seed: u64) -> Result<WorkloadSampler, LoadError> {
        let (input, output) = self.lengths()?;
        Ok(WorkloadSampler {
            config: self.clone(),
            input,
            output,
            rng: StdRng::seed_from_u64(seed ^ 0x05ee_d0f1_0ad0),
            seed,
            next_index: 0,
        })
    }
}

#[derive(Debug, Clone, Copy)]
pub enum Lengths {
    Fixed(usize),
    LogNormal(LogNormal<f64>),
}

impl Lengths {
    fn log_normal(shape: LengthShape) -> Result<Self, LoadError> {
        if !(shape.mean >= 1.0 && shape.sigma >= 0.0) {
            return Err(LoadError::invalid(
                "length mean",
                "must be at least 1 token",
                shape.mean,
            ));
        }
        // A lognormal's mean is exp(mu + sigma^2 / 2).
        let mu = shape.mean.ln() - shape.sigma * shape.sigma / 2.0;
        LogNormal::new(mu, shape.sigma)
            .map(Lengths::LogNormal)
            .map_err(|e| LoadError::invalid("length sigma", e.to_string(), shape.sigma))
    }

    fn sample(&self, rng: &mut StdRng, max: usize) -> usize {
        let n = match self {
            Lengths::Fixed(n) => *n,
            Lengths::LogNormal(d) => d.sample(rng).round() as usize,
        };
        n.clamp(1, max)
    }
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub index: u64,
    /// The whole prompt, for the completion APIs.
    pub prompt: String,
    /// For the chat API, a system message and the user's message, which together are `prompt`.
    pub system: Option<String>,
    pub user: String,
    /// Prompt tokens asked for (the system prompt included).
    pub input_len: usize,
    pub output_len: usize,
}

/// Draws requests one after another; seeded, so a run can be repeated exactly.
pub struct WorkloadSampler {
    config: WorkloadConfig,
    input: Lengths,
    output: Lengths,
    rng: StdRng,
    seed: u64,
    next_index: u64,
}

/// What one request is made of, before any text: its lengths and its prompt as segments of
/// seeded tokens. [`WorkloadSampler::next_request`] renders it as text for a server; the
/// simulator (the `simulator` crate) turns the same segments into token ids, so a simulated run
/// serves the very lengths and shared prefixes a real run with the same seed sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPlan {
    pub index: u64,
    /// Prompt tokens (the system prompt included).
    pub input_len: usize,
    pub output_len: usize,
    /// `(num_tokens, seed)` pieces of the prompt in order; equal seeds are equal tokens.
    pub segments: Vec<(usize, u64)>,
    /// How many leading segments are the system prompt (shared-prefix only).
    pub system_segments: usize,
}

impl RequestPlan {
    /// Token ids standing for the prompt: each segment's tokens follow from its seed alone, so
    /// requests sharing a system prompt share a prefix of ids (and of KV blocks).
    pub fn token_ids(&self, vocab: u32) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.input_len);
        for &(num_tokens, seed) in &self.segments {
            let mut state = seed;
            for _ in 0..num_tokens {
                state = crate::prompt::splitmix(state);
                out.push((state % u64::from(vocab.max(1))) as u32);
            }
        }
        out
    }
}

impl WorkloadSampler {
    /// The next request's lengths and prompt segments.
    pub fn next_plan(&mut self) -> RequestPlan {
        let index = self.next_index;
        self.next_index += 1;
        let c = &self.config;
        let input_len = self.input.sample(&mut self.rng, c.max_input_len);
        let output_len = self.output.sample(&mut self.rng, c.max_output_len);
        // Seeds derive from the run's seed and the request's index, so two runs with
        // different seeds share no prompts, and no two requests of one run share a prefix
        // unless the workload means them to.
        let unique = mix(self.seed, 1, index);
        if c.kind == WorkloadKind::MultiTurn {
            return self.multi_turn_plan(index, input_len, output_len);
        }
        if c.kind != WorkloadKind::SharedPrefix {
            return RequestPlan {
                index,
                input_len,
                output_len,
                segments: vec![(input_len, unique)],
                system_segments: 0,
            };
        }
        let group = self.rng.random_range(0..c.prefixes as u64);
        let user = self.rng.random_range(0..c.users as u64);
        let context_len = input_len / 2;
        RequestPlan {
            index,
            input_len: c.prefix_len + input_len,
            output_len,
            segments: vec![
                (c.prefix_len, mix(self.seed, 2, group)),
                (context_len, mix(self.seed, 3, (group << 32) | user)),
                (input_len - context_len, unique),
            ],
            system_segments: 1,
        }
    }

    /// Turn `k` of its conversation: the system prompt, `k` exchanges, the new message.
    fn multi_turn_plan(&self, index: u64, input_len: usize, output_len: usize) -> RequestPlan {
        let c = &self.config;
        let (conversation, turn) = turn_of(index, c.users);
        let seed = |stream, j: usize| mix(self.seed, stream, (conversation << 8) | j as u64);
        let mut segments = vec![(c.prefix_len, mix(self.seed, 2, conversation))];
        for j in 0..turn {
            segments.push((input_len, seed(5, j)));
            segments.push((output_len, seed(6, j)));
        }
        segments.push((input_len, seed(5, turn)));
        RequestPlan {
            index,
            input_len: c.prefix_len + (turn + 1) * input_len + turn * output_len,
            output_len,
            segments,
            system_segments: 1,
        }
    }

    pub fn next_request(&mut self) -> RequestSpec {
        let plan = self.next_plan();
        let style = self.config.prompt_style;
        let text = |segments: &[(usize, u64)]| {
            let mut b = PromptBuilder::new(style);
            for &(num_tokens, seed) in segments {
                b.push(num_tokens, seed);
            }
            b.build()
        };
        let prompt = text(&plan.segments);
        let (system, user) = if plan.system_segments == 0 {
            (None, prompt.clone())
        } else {
            (
                Some(text(&plan.segments[..plan.system_segments])),
                text(&plan.segments[plan.system_segments..]),
            )
        };
        RequestSpec {
            index: plan.index,
            prompt,
            system,
            user,
            input_len: plan.input_len,
            output_len: plan.output_len,
        }
    }
}

fn mix(seed: u64, stream: u64, value: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream.rotate_left(48) ^ value
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kind: WorkloadKind) -> WorkloadConfig {
        WorkloadConfig {
            kind,
            input_len: None,
            output_len: None,
            max_input_len: 1 << 30,
            max_output_len: 1 << 30,
            ..WorkloadConfig::fixed(1, 1, PromptStyle::Words)
        }
    }

    fn means(c: &WorkloadConfig, n: usize) -> (f64, f64) {
        let mut s = c.sampler(3).expect("valid");
        let (mut i, mut o) = (0.0, 0.0);
        for _ in 0..n {
            // Lengths only: building 20,000 prompts is not what is being tested.
            i += s.input.sample(&mut s.rng, c.max_input_len) as f64;
            o += s.output.sample(&mut s.rng, c.max_output_len) as f64;
        }
        (i / n as f64, o / n as f64)
    }

    #[test]
    fn sharegpt_lengths_have_the_papers_means() {
        let (i, o) = means(&config(WorkloadKind::Sharegpt), 40_000);
        assert!((i - 161.31).abs() < 161.31 * 0.04, "input mean {i}");
        assert!((o - 337.99).abs() < 337.99 * 0.04, "output mean {o}");
    }

    #[test]
    fn summarise_lengths_are_long_in_short_out() {
        let (i, o) = means(&config(WorkloadKind::Summarise), 40_000);
        assert!((i - 1536.0).abs() < 1536.0 * 0.03, "input mean {i}");
        assert!((o - 128.0).abs() < 128.0 * 0.03, "output mean {o}");
    }

    #[test]
    fn given_lengths_replace_the_means_and_clamps_hold() {
        let c = WorkloadConfig {
            input_len: Some(40),
            output_len: Some(20),
            ..config(WorkloadKind::Sharegpt)
        };
        let (i, o) = means(&c, 40_000);
        assert!((i - 40.0).abs() < 40.0 * 0.05, "input mean {i}");
        assert!((o - 20.0).abs() < 20.0 * 0.05, "output mean {o}");
        let clamped = WorkloadConfig {
            max_input_len: 50,
            max_output_len: 10,
            ..c
        };
        let mut s = clamped.sampler(1).expect("valid");
        for _ in 0..500 {
            let r = s.next_request();
            assert!((1..=50).contains(&r.input_len) && (1..=10).contains(&r.output_len));
            assert_eq!(r.prompt.split(' ').count(), r.input_len);
        }
    }

    #[test]
    fn fixed_requests_have_fixed_lengths_and_distinct_prompts() {
        let c = WorkloadConfig::fixed(16, 8, PromptStyle::Words);
        let mut s = c.sampler(0).expect("valid");
        let (a, b) = (s.next_request(), s.next_request());
        assert_eq!((a.input_len, a.output_len, a.index), (16, 8, 0));
        assert_eq!(b.index, 1);
        assert_ne!(a.prompt, b.prompt);
        assert_eq!(a.prompt.split(' ').count(), 16);
    }

    #[test]
    fn shared_prefix_requests_share_their_groups_system_prompt() {
        let c = WorkloadConfig {
            kind: WorkloadKind::SharedPrefix,
            input_len: Some(10),
            output_len: Some(4),
            prefixes: 2,
            users: 3,
            prefix_len: 20,
            ..WorkloadConfig::fixed(1, 1, PromptStyle::Words)
        };
        let mut s = c.sampler(9).expect("valid");
        let reqs: Vec<_> = (0..60).map(|_| s.next_request()).collect();
        let systems: std::collections::BTreeSet<_> =
            reqs.iter().filter_map(|r| r.system.clone()).collect();
        assert_eq!(systems.len(), 2, "one system prompt per group");
        for r in &reqs {
            let system = r
                .system
                .as_deref()
                .expect("shared-prefix has a system prompt");
            assert!(r.prompt.starts_with(system));
            assert_eq!(r.input_len, 30);
            assert_eq!(r.prompt.split(' ').count(), 30);
            assert_eq!(r.user.split(' ').count(), 10);
        }
        let users: std::collections::BTreeSet<_> = reqs
            .iter()
            .map(|r| r.user.split(' ').take(5).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(
            users.len(),
            6,
            "2 prefixes x 3 users have 6 distinct contexts"
        );
    }

    #[test]
    fn plans_match_requests_and_shared_prefixes_share_token_ids() {
        let c = WorkloadConfig {
            kind: WorkloadKind::SharedPrefix,
            input_len: Some(10),
            output_len: Some(4),
            prefixes: 1,
            users: 2,
            prefix_len: 20,
            ..WorkloadConfig::fixed(1, 1, PromptStyle::Words)
        };
        let (mut a, mut b) = (c.sampler(4).expect("valid"), c.sampler(4).expect("valid"));
        let (plan, spec) = (a.next_plan(), b.next_request());
        assert_eq!(
            (plan.input_len, plan.output_len),
            (spec.input_len, spec.output_len)
        );
        let (x, y) = (a.next_plan().token_ids(1000), a.next_plan().token_ids(1000));
        assert_eq!(x.len(), 30);
        assert_eq!(x[..20], y[..20], "one system prompt");
        let fixed = WorkloadConfig::fixed(16, 2, PromptStyle::Words);
        let mut s = fixed.sampler(0).expect("valid");
        let (p, q) = (s.next_plan().token_ids(1000), s.next_plan().token_ids(1000));
        assert_ne!(p[..4], q[..4]);
    }

    #[test]
    fn multi_turn_requests_repeat_their_conversation_so_far() {
        let c = WorkloadConfig {
            kind: WorkloadKind::MultiTurn,
            input_len: Some(6),
            output_len: Some(4),
            users: 3,
            prefix_len: 10,
            ..WorkloadConfig::fixed(1, 1, PromptStyle::Words)
        };
        let mut s = c.sampler(2).expect("valid");
        let reqs: Vec<_> = (0..2 * 3 * TURNS).map(|_| s.next_request()).collect();
        for (i, r) in reqs.iter().enumerate() {
            let (conversation, turn) = turn_of(i as u64, 3);
            assert_eq!(conversation, (i / (3 * TURNS) * 3 + i % 3) as u64);
            assert_eq!(turn, i / 3 % TURNS);
            assert_eq!(r.input_len, 10 + (turn + 1) * 6 + turn * 4);
            assert_eq!(r.prompt.split(' ').count(), r.input_len);
            if turn > 0 {
                // The previous turn's prompt, its answer and the new message.
                let previous = &reqs[i - 3].prompt;
                assert!(
                    r.prompt.starts_with(previous.as_str()),
                    "turn {turn} of {i}"
                );
                assert_eq!(r.input_len, reqs[i - 3].input_len + 4 + 6);
            } else if i >= 3 {
                // A new conversation shares nothing with the one before it.
                assert_ne!(r.prompt[..20], reqs[i - 3].prompt[..20]);
            }
        }
        let first: std::collections::BTreeSet<_> =
            reqs[..3].iter().map(|r| r.system.clone()).collect();
        assert_eq!(first.len(), 3, "one system prompt per conversation");
    }

    #[test]
    fn zero_lengths_are_refused() {
        let c = WorkloadConfig::fixed(0, 8, PromptStyle::Words);
        assert!(c.sampler(0).is_err());
    }
}
