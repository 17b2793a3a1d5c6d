//! The KV link's timing in the simulator. The cost model itself (step times, KV bytes, the
//! profiles) lives in [`engine::cost`], shared with the mock engine; it is re-exported here.

pub use engine::cost::*;

/// When the KV of a prompt reaches the decode node, and when the link is next free.
///
/// `link_free_s` is when the prefill node's link finishes its earlier transfers;
/// `step_start_s..step_end_s` is the prefill step in which the prompt completed.
pub fn kv_arrival_s(
    cost: &CostModel,
    prompt_tokens: usize,
    step_start_s: f64,
    step_end_s: f64,
    link_free_s: f64,
) -> (f64, f64) {
    let link = &cost.link;
    let layers = cost.model.num_layers;
    let total_s = cost.kv_bytes(prompt_tokens) / link.bandwidth_bytes_per_s;
    let mut free = link_free_s;
    if link.layerwise {
        let per_layer_s = total_s / layers as f64;
        let step_s = step_end_s - step_start_s;
        for l in 0..layers {
            let ready = step_start_s + step_s * (l + 1) as f64 / layers as f64;
            free = free.max(ready) + per_layer_s;
        }
    } else {
        free = free.max(step_end_s) + total_s;
    }
    (free + link.latency_s, free)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    pub(crate) use engine::cost::testing::tiny_linear as linear;

    #[test]
    fn layerwise_push_overlaps_the_step_and_after_prefill_does_not() {
        let mut m = linear(
            Linear3 {
                a: 0.0,
                b: 0.0,
                c: 0.0,
            },
            Linear3 {
                a: 0.0,
                b: 0.0,
                c: 0.0,
            },
        );
        // 1000 tokens * 1024 B = 1.024 MB at 1 MB/s: 1.024 s; a 4-layer step of 4 s.
        let (arrive, _) = kv_arrival_s(&m, 1000, 0.0, 4.0, 0.0);
        // Layers ready at 1, 2, 3, 4 s, each 0.256 s to send: the last ends at 4.256 s.
        assert!((arrive - (4.256 + 0.001)).abs() < 1e-9, "{arrive}");
        m.link.layerwise = false;
        let (arrive, free) = kv_arrival_s(&m, 1000, 0.0, 4.0, 0.0);
        assert!((arrive - (5.024 + 0.001)).abs() < 1e-9, "{arrive}");
        assert!((free - 5.024).abs() < 1e-9);
        // A busy link delays both.
        let (arrive, _) = kv_arrival_s(&m, 1000, 0.0, 4.0, 10.0);
        assert!((arrive - 11.025).abs() < 1e-9, "{arrive}");
    }
}
