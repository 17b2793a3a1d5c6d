//! Request limits: TGI's max input and max total tokens, and the model's context.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, greedy, stories};
use engine::engine::EngineConfig;
use engine::error::EngineError;

#[test]
fn prompts_and_totals_over_the_limits_are_refused_with_the_numbers() {
    let model = stories();
    let mut e = engine(
        &model,
        EngineConfig {
            num_kv_blocks: Some(64),
            max_input_tokens: Some(8),
            max_total_tokens: Some(20),
            ..Default::default()
        },
    );
    let err = e
        .add_request(greedy(1, vec![1; 9], 4))
        .expect_err("9 > 8 input tokens");
    assert!(
        matches!(
            err,
            EngineError::PromptTooLong {
                num_tokens: 9,
                limit: 8
            }
        ),
        "{err}"
    );
    let err = e
        .add_request(greedy(2, vec![1; 8], 13))
        .expect_err("8 + 13 > 20 total tokens");
    assert!(
        matches!(
            err,
            EngineError::PromptTooLong {
                num_tokens: 21,
                limit: 20
            }
        ),
        "{err}"
    );
    e.add_request(greedy(3, vec![1; 8], 12))
        .expect("8 + 12 fits");
    // The model's own context (512) caps a larger configured limit.
    let mut e = engine(
        &model,
        EngineConfig {
            num_kv_blocks: Some(64),
            max_total_tokens: Some(100_000),
            ..Default::default()
        },
    );
    let err = e
        .add_request(greedy(4, vec![1; 10], 503))
        .expect_err("over the context");
    assert!(err.to_string().contains("512"), "{err}");
}
