//! The decode node's book of open reservations, which every incoming frame is checked against.
//!
//! A frame is admitted only if its `xfer_id` is registered, its epoch is the registered epoch,
//! its layout's geometry, `num_layers` and `block_ids` (all, or a sliding layer's suffix) match
//! the reservation, and its layer has not arrived
//! and is not arriving on another stream. Frames with an older epoch, and frames for a transfer
//! that was deregistered, are ignored and counted: they are what a retried or cancelled sender
//! leaves in flight, not faults of the connection.
//!
//! State sits behind one `std::sync::Mutex` held only for map lookups, never across an
//! `.await` or a sink write. That costs nanoseconds per multi-megabyte frame, which is cheaper
//! than an actor's channel round trip on the receive path.
//!
//! Deregistration (and re-registration with a newer epoch) is a write fence: it returns only
//! once every sink write already admitted for the old registration has finished, so the decode
//! node can free or reuse the blocks as soon as `deregister` returns.

use kv_types::TransferId;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{watch, RwLock};

use crate::error::KvTransferError;
use crate::frame::FrameHeader;
use kv_types::KvLayout;

mod claim;
mod peer;
mod status;

pub use claim::LayerClaim;
pub use peer::{peer_fingerprint, PeerFingerprint};
pub use status::{Admission, Ignored, Outcome, RegistryStats, TransferProgress, TransferStatus};

/// Who sent a frame, as its connection authenticated it: the DER of the peer's certificate
/// (QUIC's mutual TLS). A reservation is bound to the peer the gateway chose for its epoch, or
/// without a choice to the first peer whose frame it admits there, and refuses every other one
/// (issue 31, [`peer`]); a connection without an identity (TCP, which runs only under
/// `--insecure`) binds nothing.
pub type PeerKey = Arc<[u8]>;

/// What the decode node reserved for one transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    pub xfer_id: TransferId,
    pub epoch: u64,
    pub block_ids: Arc<[u32]>,
    /// `layout.num_layers` is the number of layers the transfer carries.
    pub layout: KvLayout,
}

#[derive(Clone, Copy, Debug)]
pub struct RegistryConfig {
    /// How many deregistered transfers are remembered so that their late frames are ignored
    /// rather than refused as unknown.
    pub tombstone_capacity: usize,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        Self {
            tombstone_capacity: 4096,
        }
    }
}

/// Cheap `Clone` handle to the registry.
#[derive(Clone)]
pub struct TransferRegistry {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for TransferRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferRegistry")
            .field("stats", &self.stats())
            .finish()
    }
}

struct Shared {
    state: Mutex<State>,
    counters: Counters,
    tombstone_capacity: usize,
}

#[derive(Default)]
struct Counters {
    accepted: AtomicU64,
    ignored_stale_epoch: AtomicU64,
    ignored_closed: AtomicU64,
    rejected: AtomicU64,
    payload_bytes: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

#[derive(Default)]
struct State {
    transfers: HashMap<TransferId, Entry>,
    /// Deregistered xfer ids and their last epoch, oldest first in `tombstone_order`.
    tombstones: HashMap<TransferId, u64>,
    tombstone_order: VecDeque<(TransferId, u64)>,
    next_generation: u64,
}

impl State {
    fn known_epoch(&self, xfer_id: TransferId) -> Option<u64> {
        self.transfers
            .get(&xfer_id)
            .map(|e| e.epoch)
            .or_else(|| self.tombstones.get(&xfer_id).copied())
    }

    fn add_tombstone(&mut self, xfer_id: TransferId, epoch: u64, capacity: usize) {
        self.tombstones.insert(xfer_id, epoch);
        self.tombstone_order.push_back((xfer_id, epoch));
        while self.tombstone_order.len() > capacity {
            let Some((old_id, old_epoch)) = self.tombstone_order.pop_front() else {
                break;
            };
            if self.tombstones.get(&old_id) == Some(&old_epoch) {
                self.tombstones.remove(&old_id);
            }
        }
    }

    fn entry(&mut self, xfer_id: TransferId, generation: u64) -> Option<&mut Entry> {
        self.transfers
            .get_mut(&xfer_id)
            .filter(|e| e.generation == generation)
    }
}

struct Entry {
    /// Distinguishes registrations of one xfer id, so a claim never touches a successor.
    generation: u64,
    epoch: u64,
    block_ids: Arc<[u32]>,
    num_layers: u32,
    layout: KvLayout,
    layers: Vec<LayerState>,
    layers_received: u32,
    payload_bytes: u64,
    stale_frames: u64,
    /// The peer this epoch's frames come from, once one was admitted.
    peer: Option<PeerKey>,
    /// The fingerprint of the peer the gateway chose for this epoch: no other is admitted.
    chosen: Option<PeerFingerprint>,
    progress_tx: watch::Sender<u32>,
    /// Sink writes hold it shared; deregistration takes it exclusively to wait them out.
    fence: Arc<RwLock<()>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayerState {
    Pending,
    InFlight,
    Received { crc32c: u32 },
}

impl Entry {
    fn progress(&self, xfer_id: TransferId) -> TransferProgress {
        TransferProgress {
            xfer_id,
            epoch: self.epoch,
            num_layers: self.num_layers,
            layers_received: self.layers_received,
            payload_bytes: self.payload_bytes,
            layer_crc32c: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Received { crc32c } => Some(*crc32c),
                    _ => None,
                })
                .collect(),
            stale_frames: self.stale_frames,
        }
    }

    fn status(&self, xfer_id: TransferId) -> TransferStatus {
        let p = self.progress(xfer_id);
        if p.is_complete() {
            TransferStatus::Complete(p)
        } else {
            TransferStatus::Receiving(p)
        }
    }
}

impl Default for TransferRegistry {
    fn default() -> Self {
        Self::new(RegistryConfig::default())
    }
}

impl TransferRegistry {
    pub fn new(config: RegistryConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                counters: Counters::default(),
                tombstone_capacity: config.tombstone_capacity.max(1),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock; if one ever did, the maps are still whole.
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens a reservation. Registering an xfer id again needs a newer epoch: the old
    /// registration's in-flight writes are waited out first, and its frames are then ignored as
    /// stale.
    pub async fn register(&self, r: Reservation) -> Result<(), KvTransferError> {
        self.register_from(r, None).await
    }

    /// As [`TransferRegistry::register`], taking frames at the new epoch only from the peer
    /// whose certificate has the fingerprint `chosen`, when given.
    pub async fn register_from(
        &self,
        r: Reservation,
        chosen: Option<PeerFingerprint>,
    ) -> Result<(), KvTransferError> {
        let invalid = |reason: String| KvTransferError::InvalidReservation {
            xfer_id: r.xfer_id,
            reason,
        };
        r.layout
            .validate()
            .map_err(|e| invalid(format!("layout field {e}")))?;
        if r.block_ids.is_empty() {
            return Err(invalid("block_ids is empty".to_owned()));
        }
        if r.layout.layer_payload_bytes(r.block_ids.len()).is_none() {
            return Err(invalid(format!(
                "{} blocks overflow the payload size",
                r.block_ids.len()
            )));
        }

        let check_newer = |st: &State| match st.known_epoch(r.xfer_id) {
            Some(known) if r.epoch <= known => Err(KvTransferError::EpochNotNewer {
                xfer_id: r.xfer_id,
                epoch: r.epoch,
                known_epoch: known,
            }),
            _ => Ok(()),
        };
        let old_fence = {
            let mut st = self.lock();
            check_newer(&st)?;
            st.transfers.remove(&r.xfer_id).map(|old| {
                st.add_tombstone(r.xfer_id, old.epoch, self.shared.tombstone_capacity);
                old.fence
            })
        };
        if let Some(fence) = old_fence {
            drop(fence.write().await);
        }

        let mut st = self.lock();
        // Another register of this xfer id may have won while we waited.
        check_newer(&st)?;
        st.tombstones.remove(&r.xfer_id);
        let generation = st.next_generation;
        st.next_generation += 1;
        let (progress_tx, _) = watch::channel(0);
        tracing::debug!(
            xfer_id = %r.xfer_id,
            epoch = r.epoch,
            num_blocks = r.block_ids.len(),
            num_layers = r.layout.num_layers,
            "kv reservation registered"
        );
        st.transfers.insert(
            r.xfer_id,
            Entry {
                generation,
                epoch: r.epoch,
                layers: vec![LayerState::Pending; r.layout.num_layers as usize],
                block_ids: r.block_ids,
                num_layers: r.layout.num_layers,
                layout: r.layout,
                layers_received: 0,
                payload_bytes: 0,
                stale_frames: 0,
                peer: None,
                chosen,
                progress_tx,
                fence: Arc::new(RwLock::new(())),
            },
        );
        Ok(())
    }

    /// Closes a reservation (completion, cancel or lease expiry) and returns its last status.
    /// When this returns, no sink write for it is running or will start; later frames for it
    /// are dropped and counted. `None` if it was not registered.
    pub async fn deregister(&self, xfer_id: TransferId) -> Option<TransferStatus> {
        let (status, fence) = {
            let mut st = self.lock();
            let entry = st.transfers.remove(&xfer_id)?;
            st.add_tombstone(xfer_id, entry.epoch, self.shared.tombstone_capacity);
            (entry.status(xfer_id), entry.fence)
        };
        drop(fence.write().await);
        tracing::debug!(
            %xfer_id,
            complete = status.is_complete(),
            "kv reservation closed"
        );
        Some(status)
    }

    pub fn status(&self, xfer_id: TransferId) -> TransferStatus {
        let st = self.lock();
        if let Some(e) = st.transfers.get(&xfer_id) {
            return e.status(xfer_id);
        }
        match st.tombstones.get(&xfer_id) {
            Some(&epoch) => TransferStatus::Closed { epoch },
            None => TransferStatus::Unknown,
        }
    }

    /// Waits until every layer of the transfer's current registration has arrived.
    pub async fn wait_complete(
        &self,
        xfer_id: TransferId,
        timeout: Duration,
    ) -> Result<TransferProgress, KvTransferError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let mut progress_rx = {
                let st = self.lock();
                match st.transfers.get(&xfer_id) {
                    Some(e) if e.layers_received == e.num_layers => return Ok(e.progress(xfer_id)),
                    Some(e) => e.progress_tx.subscribe(),
                    None if st.tombstones.contains_key(&xfer_id) => {
                        return Err(KvTransferError::TransferClosed { xfer_id })
                    }
                    None => return Err(KvTransferError::UnknownTransfer { xfer_id }),
                }
            };
            // A closed channel means the registration was replaced or removed: look again.
            if tokio::time::timeout_at(deadline, progress_rx.changed())
                .await
                .is_err()
            {
                let (layers_received, num_layers) = match self.status(xfer_id) {
                    TransferStatus::Receiving(p) | TransferStatus::Complete(p) => {
                        (p.layers_received, p.num_layers)
                    }
                    _ => (0, 0),
                };
                return Err(KvTransferError::Timeout {
                    xfer_id,
                    timeout_ms: timeout.as_millis() as u64,
                    layers_received,
                    num_layers,
                });
            }
        }
    }

    pub fn stats(&self) -> RegistryStats {
        let c = &self.shared.counters;
        RegistryStats {
            frames_accepted: c.accepted.load(Ordering::Relaxed),
            frames_ignored_stale_epoch: c.ignored_stale_epoch.load(Ordering::Relaxed),
            frames_ignored_closed: c.ignored_closed.load(Ordering::Relaxed),
            frames_rejected: c.rejected.load(Ordering::Relaxed),
            payload_bytes_accepted: c.payload_bytes.load(Ordering::Relaxed),
            active_transfers: self.lock().transfers.len(),
        }
    }

    /// Checks a decoded header against its reservation, before its payload is read.
    pub fn admit(&self, frame: &FrameHeader) -> Result<Admission, KvTransferError> {
        self.admit_from(frame, None)
    }

    /// As [`TransferRegistry::admit`], for a frame from the authenticated `peer`: the first
    /// peer admitted at an epoch is the only one admitted after it, at that epoch.
    pub fn admit_from(
        &self,
        frame: &FrameHeader,
        peer: Option<&PeerKey>,
    ) -> Result<Admission, KvTransferError> {
        let res = self.admit_inner(frame, peer);
        if res.is_err() {
            bump(&self.shared.counters.rejected);
        }
        res
    }

    fn admit_inner(
        &self,
        frame: &FrameHeader,
        peer: Option<&PeerKey>,
    ) -> Result<Admission, KvTransferError> {
        let h = &frame.header;
        let (xfer_id, layer) = (h.xfer_id, h.layer);
        let mut st = self.lock();
        let Some(e) = st.transfers.get_mut(&xfer_id) else {
            if st.tombstones.contains_key(&xfer_id) {
                bump(&self.shared.counters.ignored_closed);
                return Ok(Admission::Ignore(Ignored::Closed));
            }
            return Err(KvTransferError::UnknownTransfer { xfer_id });
        };
        if h.epoch < e.epoch {
            e.stale_frames += 1;
            bump(&self.shared.counters.ignored_stale_epoch);
            return Ok(Admission::Ignore(Ignored::StaleEpoch {
                current_epoch: e.epoch,
            }));
        }
        if h.epoch > e.epoch {
            return Err(KvTransferError::EpochAhead {
                xfer_id,
                epoch: h.epoch,
                registered_epoch: e.epoch,
            });
        }
        if h.layout.num_layers != e.num_layers {
            return Err(KvTransferError::ReservationMismatch {
                xfer_id,
                layer,
                field: "num_layers",
                reserved: e.num_layers.to_string(),
                given: h.layout.num_layers.to_string(),
            });
        }
        // A frame carries the geometry; the layers' windows were agreed when the nodes were
        // paired (the reservation's layout), and cut which blocks a sliding layer carries.
        if !h.layout.same_geometry(&e.layout) {
            return Err(KvTransferError::ReservationMismatch {
                xfer_id,
                layer,
                field: "layout",
                reserved: e.layout.to_string(),
                given: h.layout.to_string(),
            });
        }
        // A sliding-window layer carries the blocks its window still reads at the prompt's
        // end: a suffix of the reservation's. Which suffix a layer takes is the engine's to
        // check when it imports the layer (it knows the windows and the prompt).
        if h.block_ids.is_empty() || !e.block_ids.ends_with(&h.block_ids) {
            return Err(KvTransferError::BlockIdsMismatch {
                xfer_id,
                layer,
                given: h.block_ids.len(),
                reserved: e.block_ids.len(),
            });
        }
        // Checked once the frame is otherwise one this reservation expects, so that a peer
        // sending garbage binds nothing.
        if let Some(peer) = peer {
            e.check_peer(xfer_id, h.epoch, peer)?;
        }
        let num_layers = e.num_layers;
        let slot = e
            .layers
            .get_mut(layer as usize)
            .ok_or(KvTransferError::LayerOutOfRange {
                xfer_id,
                layer,
                num_layers,
            })?;
        if *slot != LayerState::Pending {
            return Err(KvTransferError::DuplicateLayer { xfer_id, layer });
        }
        *slot = LayerState::InFlight;
        Ok(Admission::Accept(LayerClaim {
            registry: self.clone(),
            xfer_id,
            layer,
            generation: e.generation,
            block_ids: h.block_ids.clone(),
            done: false,
        }))
    }

    /// Counts a frame that ended in a refusal after admission (bad payload, sink failure).
    fn reject_after_admit(&self) {
        bump(&self.shared.counters.rejected);
    }

    /// Why a claim's registration is gone, counted.
    fn ignored_after_admit(&self, st: &mut State, xfer_id: TransferId) -> Ignored {
        match st.transfers.get_mut(&xfer_id) {
            Some(e) => {
                e.stale_frames += 1;
                bump(&self.shared.counters.ignored_stale_epoch);
                Ignored::StaleEpoch {
                    current_epoch: e.epoch,
                }
            }
            None => {
                bump(&self.shared.counters.ignored_closed);
                Ignored::Closed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use crate::verdict::Verdict;

    use super::*;
    use crate::header::LayerHeader;
    use crate::sink::MemorySink;
    use kv_types::{KvDtype, TransferId};

    const LAYOUT: KvLayout = KvLayout {
        dtype: KvDtype::F32,
        num_layers: 2,
        block_size: 2,
        num_kv_heads: 1,
        head_dim: 2,
        windows: kv_types::LayerWindows::NONE,
    };

    fn reservation(xfer_id: TransferId, epoch: u64) -> Reservation {
        Reservation {
            xfer_id,
            epoch,
            block_ids: vec![3, 1].into(),
            layout: KvLayout {
                num_layers: 2,
                ..LAYOUT
            },
        }
    }

    fn frame(xfer_id: TransferId, epoch: u64, layer: u32) -> (FrameHeader, Bytes) {
        let header = LayerHeader {
            xfer_id,
            epoch,
            layer,
            layout: KvLayout {
                num_layers: 2,
                ..LAYOUT
            },
            block_ids: vec![3, 1].into(),
            traceparent: None,
        };
        let len = header.expected_payload_bytes().unwrap() as usize;
        let payload = Bytes::from(vec![layer as u8 + 1; len]);
        (FrameHeader::for_payload(header, &payload), payload)
    }

    fn deliver(
        reg: &TransferRegistry,
        sink: &MemorySink,
        f: &(FrameHeader, Bytes),
    ) -> Result<Verdict, KvTransferError> {
        match reg.admit(&f.0)? {
            Admission::Accept(claim) => Ok(claim.complete(sink, &f.0, f.1.clone())?.verdict()),
            Admission::Ignore(i) => Ok(i.verdict()),
        }
    }

    /// A sliding-window layer's frame carries the tail of the reservation's blocks; any other
    /// part of them is refused, and the sink writes the blocks the frame names.
    #[tokio::test]
    async fn a_layer_may_carry_a_suffix_of_the_reserved_blocks_and_nothing_else() {
        let reg = TransferRegistry::default();
        let sink = MemorySink::new(2, 4, LAYOUT);
        reg.register(reservation(TransferId(7), 1)).await.unwrap();
        let with_blocks = |layer: u32, ids: Vec<u32>| {
            let (mut h, _) = frame(TransferId(7), 1, layer);
            h.header.block_ids = ids.into();
            let len = h.header.expected_payload_bytes().unwrap() as usize;
            let payload = Bytes::from(vec![9u8; len]);
            (FrameHeader::for_payload(h.header, &payload), payload)
        };
        for refused in [vec![3], vec![1, 3], vec![1, 1], vec![0, 3, 1]] {
            let err = deliver(&reg, &sink, &with_blocks(0, refused.clone())).unwrap_err();
            assert!(
                matches!(err, KvTransferError::BlockIdsMismatch { .. }),
                "{refused:?}: {err}"
            );
        }
        assert_eq!(
            deliver(&reg, &sink, &with_blocks(0, vec![1])).unwrap(),
            Verdict::Accepted
        );
        assert_eq!(
            sink.layer_bytes(TransferId(7), 0),
            Some(2 * LAYOUT.block_bytes())
        );
        // The windows are agreed when nodes pair; a frame's layout is its geometry.
        let mut windowed = with_blocks(1, vec![3, 1]);
        windowed.0.header.layout.windows = kv_types::LayerWindows(5);
        assert_eq!(deliver(&reg, &sink, &windowed).unwrap(), Verdict::Accepted);
        assert!(reg.status(TransferId(7)).is_complete());
    }

    #[tokio::test]
    async fn accepts_each_layer_once_then_completes() {
        let reg = TransferRegistry::default();
        let sink = MemorySink::new(2, 4, LAYOUT);
        reg.register(reservation(TransferId(7), 1)).await.unwrap();
        assert_eq!(
            deliver(&reg, &sink, &frame(TransferId(7), 1, 0)).unwrap(),
            Verdict::Accepted
        );
        let dup = deliver(&reg, &sink, &frame(TransferId(7), 1, 0)).unwrap_err();
        assert!(matches!(
            dup,
            KvTransferError::DuplicateLayer {
                xfer_id: TransferId(7),
                layer: 0
            }
        ));
        assert!(!reg.status(TransferId(7)).is_complete());
        assert_eq!(
            deliver(&reg, &sink, &frame(TransferId(7), 1, 1)).unwrap(),
            Verdict::Accepted
        );
        let p = reg
            .wait_complete(TransferId(7), Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(p.layers_received, 2);
        assert!(p.layer_crc32c.iter().all(Option::is_some));
    }

    #[tokio::test]
    async fn old_epoch_is_ignored_and_counted() {
        let reg = TransferRegistry::default();
        let sink = MemorySink::new(2, 4, LAYOUT);
        reg.register(reservation(TransferId(7), 1)).await.unwrap();
        reg.register(reservation(TransferId(7), 2)).await.unwrap();
        assert_eq!(
            deliver(&reg, &sink, &frame(TransferId(7), 1, 0)).unwrap(),
            Verdict::StaleEpoch
        );
        assert_eq!(
            deliver(&reg, &sink, &frame(TransferId(7), 2, 0)).unwrap(),
            Verdict::Accepted
        );
        let err = deliver(&reg, &sink, &frame(TransferId(7), 3, 1)).unwrap_err();
        assert!(matches!(err, KvTransferError::EpochAhead { .. }));
        let stats = reg.stats();
        assert_eq!(stats.frames_ignored_stale_epoch, 1);
        assert_eq!(stats.frames_accepted, 1);
        assert_eq!(stats.frames_rejected, 1);
        let err = reg
            .register(reservation(TransferId(7), 2))
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            KvTransferError::EpochNotNewer { known_epoch: 2, .. }
        ));
    }

    #[tokio::test]
    async fn old_epoch_frame_from_the_wire_is_ignored() {
        use crate::frame::{decode_frame, FrameLimits};
        let reg = TransferRegistry::default();
        reg.register(reservation(TransferId(7), 4)).await.unwrap();
        let (h, p) = frame(TransferId(7), 3, 0);
        let mut wire = h.encode(&FrameLimits::default()).unwrap().to_vec();
        wire.extend_from_slice(&p);
        let (decoded, payload) = decode_frame(wire.into(), &FrameLimits::default()).unwrap();
        assert_eq!(payload, p);
        assert!(matches!(
            reg.admit(&decoded).unwrap(),
            Admission::Ignore(Ignored::StaleEpoch { current_epoch: 4 })
        ));
        assert_eq!(reg.stats().frames_ignored_stale_epoch, 1);
        assert!(
            matches!(reg.status(TransferId(7)), TransferStatus::Receiving(p) if p.stale_frames == 1)
        );
    }

    #[tokio::test]
    async fn unknown_and_closed_transfers() {
        let reg = TransferRegistry::default();
        let sink = MemorySink::new(2, 4, LAYOUT);
        let err = deliver(&reg, &sink, &frame(TransferId(9), 1, 0)).unwrap_err();
        assert!(matches!(
            err,
            KvTransferError::UnknownTransfer {
                xfer_id: TransferId(9)
            }
        ));
        reg.register(reservation(TransferId(9), 1)).await.unwrap();
        let status = reg.deregister(TransferId(9)).await.unwrap();
        assert!(matches!(status, TransferStatus::Receiving(_)));
        assert_eq!(
            deliver(&reg, &sink, &frame(TransferId(9), 1, 0)).unwrap(),
            Verdict::TransferClosed
        );
        assert_eq!(
            reg.status(TransferId(9)),
            TransferStatus::Closed { epoch: 1 }
        );
        assert_eq!(reg.stats().frames_ignored_closed, 1);
        assert!(matches!(
            reg.wait_complete(TransferId(9), Duration::from_millis(10))
                .await,
            Err(KvTransferError::TransferClosed {
                xfer_id: TransferId(9)
            })
        ));
    }

    #[tokio::test]
    async fn dropped_claim_frees_the_layer_and_bad_checksum_is_refused() {
        let reg = TransferRegistry::default();
        let sink = MemorySink::new(2, 4, LAYOUT);
        reg.register(reservation(TransferId(5), 1)).await.unwrap();
        let (h, p) = frame(TransferId(5), 1, 0);
        let Admission::Accept(claim) = reg.admit(&h).unwrap() else {
            panic!("not admitted")
        };
        let mut bad = p.to_vec();
        bad[0] ^= 1;
        let err = claim.complete(&sink, &h, bad.into()).unwrap_err();
        assert!(matches!(
            err,
            KvTransferError::ChecksumMismatch {
                xfer_id: TransferId(5),
                layer: 0,
                ..
            }
        ));
        // The layer is pending again, so the good copy goes through.
        assert_eq!(deliver(&reg, &sink, &(h, p)).unwrap(), Verdict::Accepted);
    }

    #[tokio::test]
    async fn deregister_during_claim_ignores_the_write() {
        let reg = TransferRegistry::default();
        let sink = MemorySink::new(2, 4, LAYOUT);
        reg.register(reservation(TransferId(6), 1)).await.unwrap();
        let (h, p) = frame(TransferId(6), 1, 1);
        let Admission::Accept(claim) = reg.admit(&h).unwrap() else {
            panic!("not admitted")
        };
        reg.deregister(TransferId(6)).await.unwrap();
        assert_eq!(
            claim.complete(&sink, &h, p).unwrap(),
            Outcome::Ignored(Ignored::Closed)
        );
        assert!(sink.layer_bytes(TransferId(6), 1).is_none());
    }

    #[tokio::test]
    async fn wait_complete_times_out_with_progress() {
        let reg = TransferRegistry::default();
        let sink = MemorySink::new(2, 4, LAYOUT);
        reg.register(reservation(TransferId(8), 1)).await.unwrap();
        deliver(&reg, &sink, &frame(TransferId(8), 1, 1)).unwrap();
        let err = reg
            .wait_complete(TransferId(8), Duration::from_millis(20))
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            KvTransferError::Timeout {
                xfer_id: TransferId(8),
                layers_received: 1,
                num_layers: 2,
                ..
            }
        ));
    }

    #[tokio::test]
    async fn tombstones_are_bounded() {
        let reg = TransferRegistry::new(RegistryConfig {
            tombstone_capacity: 2,
        });
        for id in 0..3 {
            reg.register(reservation(TransferId(id), 1)).await.unwrap();
            reg.deregister(TransferId(id)).await.unwrap();
        }
        assert_eq!(reg.status(TransferId(0)), TransferStatus::Unknown);
        assert_eq!(
            reg.status(TransferId(2)),
            TransferStatus::Closed { epoch: 1 }
        );
    }
}
