//! One forward pass's input: a ragged batch of prefill chunks and decode rows, no padding.

/// One sequence's slice of the batch.
#[derive(Debug, Clone)]
pub struct SeqSlice {
    /// First row of this sequence in the batch's token rows.
    pub q_start: usize,
    /// Number of new tokens this step.
    pub q_len: usize,
    /// Tokens in the cache after this step (prefix + new).
    pub context_len: usize,
    /// Physical blocks covering `context_len` tokens.
    pub block_table: Vec<u32>,
}

/// Inputs for [`crate::model::Model::forward`].
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    /// Cache slot (`block * block_size + offset`) each new token's K/V is written to.
    pub slots: Vec<u32>,
    pub seqs: Vec<SeqSlice>,
    /// Token rows whose logits are needed (the last row of each chunk that samples).
    pub logits_rows: Vec<u32>,
    /// The same step as each sliding-window layer group sees it (group 1 first): the same
    /// tokens, rows and positions, with that group's block tables and slots
    /// ([`crate::kv::groups`]). Empty when every layer is in group 0.
    pub windows: Vec<ForwardBatch>,
}

impl ForwardBatch {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// The step as the layers of KV group `group` see it. A batch built without group views
    /// gives every layer group 0's tables (each pool must then hold those blocks; the
    /// kernels refuse an id past a pool).
    pub fn for_group(&self, group: usize) -> &ForwardBatch {
        match group {
            0 => self,
            g => self.windows.get(g - 1).unwrap_or(self),
        }
    }

    /// Gives every group's view the logits rows of the step, once they are all pushed.
    pub fn share_logits_rows(&mut self) {
        for view in &mut self.windows {
            view.logits_rows.clone_from(&self.logits_rows);
        }
    }

    /// Appends one sequence's chunk: tokens at positions `start_pos..`, written into the slots
    /// that `block_table` maps them to.
    pub fn push_seq(
        &mut self,
        token_ids: &[u32],
        start_pos: usize,
        block_table: Vec<u32>,
        block_size: usize,
        want_logits: bool,
    ) {
        let q_start = self.token_ids.len();
        for (i, &t) in token_ids.iter().enumerate() {
            let pos = start_pos + i;
            self.token_ids.push(t);
            self.positions.push(pos as u32);
            self.slots.push(
                block_table[pos / block_size] * block_size as u32 + (pos % block_size) as u32,
            );
        }
        if want_logits {
            self.logits_rows
                .push((q_start + token_ids.len() - 1) as u32);
        }
        self.seqs.push(SeqSlice {
            q_start,
            q_len: token_ids.len(),
            context_len: start_pos + token_ids.len(),
            block_table,
        });
    }
}
