//! Which peer may fill a reservation. The gateway chooses the prefill node for each epoch and
//! tells the decode node by the SHA-256 of that node's certificate (its `kv_identity`); the
//! reservation then admits frames from that certificate only (issue 31). Without a choice it
//! binds to the first certificate whose frame it admits at the epoch. A connection without an
//! identity (plain TCP, only under `--insecure`) is not checked at all: it has none to check.

use kv_types::TransferId;
use sha2::{Digest, Sha256};

use super::{Entry, PeerKey, TransferRegistry};
use crate::error::KvTransferError;

/// SHA-256 of a certificate's DER: how the cluster names a prefill node's KV identity.
pub type PeerFingerprint = [u8; 32];

/// The fingerprint of the certificate `cert_der`.
pub fn peer_fingerprint(cert_der: &[u8]) -> PeerFingerprint {
    Sha256::digest(cert_der).into()
}

impl Entry {
    /// Admits `peer` at this entry's epoch, binding it if none is bound yet. The fingerprint is
    /// computed once per epoch, when the first frame binds; later frames compare the DER.
    pub(super) fn check_peer(
        &mut self,
        xfer_id: TransferId,
        epoch: u64,
        peer: &PeerKey,
    ) -> Result<(), KvTransferError> {
        let wrong = || KvTransferError::WrongPeer { xfer_id, epoch };
        match &self.peer {
            Some(bound) if bound != peer => Err(wrong()),
            Some(_) => Ok(()),
            None => {
                if self.chosen.is_some_and(|fp| fp != peer_fingerprint(peer)) {
                    return Err(wrong());
                }
                self.peer = Some(peer.clone());
                Ok(())
            }
        }
    }
}

impl TransferRegistry {
    /// Binds the registration of `xfer_id` at `epoch` to the peer whose certificate has the
    /// fingerprint `chosen`: from now on it admits frames from that peer only. Refused when
    /// the registration is at another epoch, or already took frames from another peer.
    pub fn bind(
        &self,
        xfer_id: TransferId,
        epoch: u64,
        chosen: PeerFingerprint,
    ) -> Result<(), KvTransferError> {
        let mut st = self.lock();
        let Some(e) = st.transfers.get_mut(&xfer_id) else {
            return Err(KvTransferError::UnknownTransfer { xfer_id });
        };
        if e.epoch != epoch {
            return Err(KvTransferError::InvalidReservation {
                xfer_id,
                reason: format!(
                    "binding at epoch {epoch}, the reservation is at epoch {}",
                    e.epoch
                ),
            });
        }
        if let Some(bound) = &e.peer {
            if peer_fingerprint(bound) != chosen {
                return Err(KvTransferError::WrongPeer { xfer_id, epoch });
            }
        }
        e.chosen = Some(chosen);
        Ok(())
    }
}
