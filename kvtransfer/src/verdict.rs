//! The receiver's 4-byte answer to each frame: `"KA"`, the protocol version, a code.

use std::fmt;

use crate::version::VERSION;

/// Length of the receiver's answer to one frame.
pub const ACK_LEN: usize = 4;
const ACK_MAGIC: [u8; 2] = *b"KA";

/// The receiver's answer to one frame.
///
/// `Accepted` means the payload passed its checksum and the sink took it. `StaleEpoch` and
/// `TransferClosed` are frames the receiver ignored (counted, not errors on its side). The rest
/// are refusals. The code doubles as the QUIC `STOP_SENDING` code when the receiver refuses a
/// frame before reading its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Verdict {
    Accepted = 0,
    StaleEpoch = 1,
    TransferClosed = 2,
    UnknownTransfer = 3,
    EpochAhead = 4,
    BlockIdsMismatch = 5,
    LayoutMismatch = 6,
    LayerOutOfRange = 7,
    DuplicateLayer = 8,
    ChecksumMismatch = 9,
    TooLarge = 10,
    Malformed = 11,
    SinkFailed = 12,
    ShuttingDown = 13,
    /// The reservation takes frames from another prefill node.
    WrongPeer = 14,
}

impl Verdict {
    const ALL: [Verdict; 15] = [
        Self::Accepted,
        Self::StaleEpoch,
        Self::TransferClosed,
        Self::UnknownTransfer,
        Self::EpochAhead,
        Self::BlockIdsMismatch,
        Self::LayoutMismatch,
        Self::LayerOutOfRange,
        Self::DuplicateLayer,
        Self::ChecksumMismatch,
        Self::TooLarge,
        Self::Malformed,
        Self::SinkFailed,
        Self::ShuttingDown,
        Self::WrongPeer,
    ];

    pub fn from_code(code: u64) -> Option<Self> {
        Self::ALL.into_iter().find(|v| *v as u64 == code)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::StaleEpoch => "stale_epoch",
            Self::TransferClosed => "transfer_closed",
            Self::UnknownTransfer => "unknown_transfer",
            Self::EpochAhead => "epoch_ahead",
            Self::BlockIdsMismatch => "block_ids_mismatch",
            Self::LayoutMismatch => "layout_mismatch",
            Self::LayerOutOfRange => "layer_out_of_range",
            Self::DuplicateLayer => "duplicate_layer",
            Self::ChecksumMismatch => "checksum_mismatch",
            Self::TooLarge => "too_large",
            Self::Malformed => "malformed",
            Self::SinkFailed => "sink_failed",
            Self::ShuttingDown => "shutting_down",
            Self::WrongPeer => "wrong_peer",
        }
    }

    pub fn encode(self) -> [u8; ACK_LEN] {
        [ACK_MAGIC[0], ACK_MAGIC[1], VERSION as u8, self as u8]
    }

    pub fn decode(buf: [u8; ACK_LEN]) -> Option<Self> {
        if buf[..2] != ACK_MAGIC || buf[2] != VERSION as u8 {
            return None;
        }
        Self::from_code(u64::from(buf[3]))
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_codes_round_trip() {
        for v in Verdict::ALL {
            assert_eq!(Verdict::decode(v.encode()), Some(v));
        }
        assert_eq!(Verdict::decode(*b"KA\x01\xff"), None);
        assert_eq!(Verdict::decode(*b"XA\x01\x00"), None);
    }
}
