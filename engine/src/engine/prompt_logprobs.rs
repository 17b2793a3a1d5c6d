//! Prompt logprobs (TGI's `decoder_input_details`): the log-probability of each prompt token
//! given the tokens before it, computed by the prefill's own forward pass.
//!
//! Normally a step computes logits only for the last row of a chunk that samples. For a
//! sequence that asks for prompt logprobs, every prompt row of its chunks gets logits too: row
//! `p` scores the prompt token at `p + 1`. The lm head then runs over the whole prompt, so the
//! step's logits take `prompt tokens x vocab x 4` bytes; that is why it is opt-in. Such a
//! sequence computes its whole prompt instead of taking blocks from the prefix cache, where
//! the cached positions would have no logits.

use crate::ids::SeqId;
use crate::model::ForwardBatch;
use crate::scheduler::BatchItem;

/// What one row of a step's logits is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowUse {
    /// Sample the next token of the batch item at this index.
    Sample(usize),
    /// Score `target`, the prompt token at `position + 1`.
    Prompt {
        seq_id: SeqId,
        position: usize,
        target: u32,
    },
}

/// Appends `item`'s chunk to `fb` and says what each logits row it adds is for. `prompt` is
/// the sequence's prompt when it wants prompt logprobs.
pub(super) fn push_item(
    fb: &mut ForwardBatch,
    uses: &mut Vec<RowUse>,
    index: usize,
    item: &BatchItem,
    block_size: usize,
    prompt: Option<&[u32]>,
) {
    let q_start = fb.num_tokens() as u32;
    let table: Vec<u32> = item.block_table.iter().map(|b| b.0).collect();
    fb.push_seq(&item.token_ids, item.start_pos, table, block_size, false);
    for (group, table) in item.window_tables.iter().enumerate() {
        if fb.windows.len() <= group {
            fb.windows.push(ForwardBatch::default());
        }
        let table = table
            .iter()
            .map(|&b| crate::kv::groups::kernel_block(b))
            .collect();
        fb.windows[group].push_seq(&item.token_ids, item.start_pos, table, block_size, false);
    }
    if let Some(prompt) = prompt {
        for i in 0..item.token_ids.len() {
            let position = item.start_pos + i;
            let Some(&target) = prompt.get(position + 1) else {
                break; // the last prompt row predicts the first generated token
            };
            fb.logits_rows.push(q_start + i as u32);
            uses.push(RowUse::Prompt {
                seq_id: item.seq_id,
                position,
                target,
            });
        }
    }
    if item.sample {
        fb.logits_rows
            .push(q_start + item.token_ids.len() as u32 - 1);
        uses.push(RowUse::Sample(index));
    }
}

/// `log_softmax(row)[target]`, from the raw logits (no temperature or penalty), as TGI
/// reports prompt tokens.
pub(super) fn logprob_at(row: &[f32], target: u32) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
    row[target as usize] - max - sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::BlockId;

    fn item(start_pos: usize, token_ids: Vec<u32>, sample: bool) -> BatchItem {
        BatchItem {
            seq_id: SeqId(7),
            context_len: start_pos + token_ids.len(),
            token_ids,
            start_pos,
            block_table: vec![BlockId(0), BlockId(1)],
            window_tables: vec![],
            sample,
            is_prefill: true,
        }
    }

    #[test]
    fn every_prompt_row_but_the_last_scores_the_next_prompt_token() {
        let prompt = [10, 11, 12, 13, 14];
        // A first chunk of three tokens: each row scores the following token.
        let (mut fb, mut uses) = (ForwardBatch::default(), Vec::new());
        push_item(
            &mut fb,
            &mut uses,
            0,
            &item(0, vec![10, 11, 12], false),
            4,
            Some(&prompt),
        );
        assert_eq!(fb.logits_rows, vec![0, 1, 2]);
        assert_eq!(
            uses.iter()
                .map(|u| match u {
                    RowUse::Prompt {
                        position, target, ..
                    } => (*position, *target),
                    RowUse::Sample(_) => panic!("the chunk does not sample"),
                })
                .collect::<Vec<_>>(),
            vec![(0, 11), (1, 12), (2, 13)]
        );
        // The last chunk: row 3 scores token 14, row 4 samples.
        push_item(
            &mut fb,
            &mut uses,
            1,
            &item(3, vec![13, 14], true),
            4,
            Some(&prompt),
        );
        assert_eq!(fb.logits_rows, vec![0, 1, 2, 3, 4]);
        assert_eq!(
            uses[3],
            RowUse::Prompt {
                seq_id: SeqId(7),
                position: 3,
                target: 14
            }
        );
        assert_eq!(uses[4], RowUse::Sample(1));
    }

    #[test]
    fn without_prompt_logprobs_only_the_sampling_row_is_computed() {
        let (mut fb, mut uses) = (ForwardBatch::default(), Vec::new());
        push_item(
            &mut fb,
            &mut uses,
            0,
            &item(0, vec![1, 2, 3], true),
            4,
            None,
        );
        push_item(&mut fb, &mut uses, 1, &item(0, vec![4, 5], false), 4, None);
        assert_eq!(fb.logits_rows, vec![2]);
        assert_eq!(uses, vec![RowUse::Sample(0)]);
    }

    #[test]
    fn logprob_is_the_log_softmax() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f32 = row.iter().map(|x| x.exp()).sum();
        for t in 0..3 {
            let want = (row[t].exp() / z).ln();
            assert!((logprob_at(&row, t as u32) - want).abs() < 1e-6);
        }
    }
}
