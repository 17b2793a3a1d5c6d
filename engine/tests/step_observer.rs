//! A step observer sees the step's plan, not every sequence handed to the engine: with a tight
//! prefill budget the second prompt sits out the first step, and a service that closes queue
//! waits on `scheduled` must see it only in the step that computes it.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{engine, greedy, stories};
use engine::engine::{EngineConfig, LayerDone, ScheduledSeq, StepObserver};
use engine::ids::SeqId;

/// Per step, the sequences scheduled; per sequence, the step that first scheduled it (where a
/// service ends its queue wait), and the layers seen.
#[derive(Default)]
struct Recorder {
    step: usize,
    steps: Vec<Vec<ScheduledSeq>>,
    first_scheduled: HashMap<SeqId, usize>,
    layers: usize,
}

impl StepObserver for Recorder {
    fn scheduled(&mut self, seqs: &[ScheduledSeq]) {
        for s in seqs {
            self.first_scheduled.entry(s.seq_id).or_insert(self.step);
        }
        self.steps.push(seqs.to_vec());
        self.step += 1;
    }

    fn layer_done(&mut self, _done: LayerDone<'_>) -> engine::error::Result<()> {
        self.layers += 1;
        Ok(())
    }
}

#[test]
fn only_sequences_in_the_plan_are_reported_as_scheduled() {
    let model = stories();
    let mut e = engine(
        &model,
        EngineConfig {
            num_kv_blocks: Some(64),
            block_size: 4,
            max_batch_prefill_tokens: 8,
            max_prefill_chunk_tokens: 8,
            ..Default::default()
        },
    );
    // Two 8-token prompts: the budget fits one per step.
    e.add_request(greedy(1, (10..18).collect(), 3))
        .expect("add 1");
    e.add_prefill_request(greedy(2, (20..28).collect(), 3))
        .expect("add 2");
    let mut rec = Recorder::default();

    let first = e.step_with_observer(&mut rec).expect("step 1");
    let ids = |s: &[ScheduledSeq]| s.iter().map(|s| s.seq_id.0).collect::<Vec<_>>();
    assert_eq!(
        ids(&rec.steps[0]),
        vec![1],
        "sequence 2 does not fit step 1"
    );
    assert_eq!(
        rec.steps[0][0],
        ScheduledSeq {
            seq_id: SeqId(1),
            num_tokens: 8,
            is_prefill: true,
            samples: true,
        }
    );
    assert_eq!(first.len(), 1);
    assert!(!rec.first_scheduled.contains_key(&SeqId(2)));
    let num_layers = model.config().num_layers;
    assert_eq!(
        rec.layers, num_layers,
        "prompt 1 completes: one call per layer"
    );

    e.step_with_observer(&mut rec).expect("step 2");
    assert_eq!(ids(&rec.steps[1]), vec![1, 2]);
    let decode = rec.steps[1][0];
    assert_eq!((decode.num_tokens, decode.is_prefill), (1, false));
    assert_eq!(
        rec.first_scheduled[&SeqId(2)],
        1,
        "its queue wait ends in step 2"
    );
    assert_eq!(rec.layers, 2 * num_layers, "then prompt 2's");
}
