//! The virtual clock's event queue: events come out in time order, and events at the same
//! time in the order they were pushed, so a seeded simulation replays exactly.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// Request `index` reaches the gateway.
    Arrival(usize),
    /// Node `index` finished its forward step, if the step's timing generation is still this
    /// one (a shared host re-times steps in progress; the older events are then stale).
    StepDone(usize, u64),
    /// Request `index`'s prompt KV is in its decode node's blocks.
    KvArrived(usize),
    /// Time to see whether the level can still meet the SLO (plans only).
    Check,
}

#[derive(Debug)]
struct Entry {
    at_s: f64,
    seq: u64,
    event: Event,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    /// Reversed, so the max-heap pops the earliest event (and the first pushed of a tie).
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at_s
            .total_cmp(&self.at_s)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

#[derive(Debug, Default)]
pub(crate) struct EventQueue {
    heap: BinaryHeap<Entry>,
    next_seq: u64,
}

impl EventQueue {
    pub(crate) fn push(&mut self, at_s: f64, event: Event) {
        self.heap.push(Entry {
            at_s,
            seq: self.next_seq,
            event,
        });
        self.next_seq += 1;
    }

    pub(crate) fn pop(&mut self) -> Option<(f64, Event)> {
        self.heap.pop().map(|e| (e.at_s, e.event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_pop_in_time_then_push_order() {
        let mut q = EventQueue::default();
        q.push(2.0, Event::StepDone(0, 0));
        q.push(1.0, Event::Arrival(1));
        q.push(1.0, Event::Arrival(2));
        q.push(0.5, Event::Check);
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            vec![
                (0.5, Event::Check),
                (1.0, Event::Arrival(1)),
                (1.0, Event::Arrival(2)),
                (2.0, Event::StepDone(0, 0)),
            ]
        );
    }
}
