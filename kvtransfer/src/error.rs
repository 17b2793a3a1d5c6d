//! The crate's one error type.
//!
//! Variants carry the ids involved (`xfer_id`, `layer`, `epoch`) and the limit and given value
//! where a limit was broken. [`KvTransferError::verdict`] is the single place that maps an error
//! to the code a receiver sends back to the sender on the wire, and
//! [`KvTransferError::error_type`] is the stable name for `proto`'s error table.

use kv_types::TransferId;
use std::io;

use crate::verdict::Verdict;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvTransferError {
    // ---- frame decoding -------------------------------------------------------------------
    #[error("truncated frame: {what} needs {needed} bytes, {given} given")]
    Truncated {
        what: &'static str,
        needed: u64,
        given: u64,
    },
    #[error("frame has {extra} trailing bytes after its payload")]
    TrailingBytes { extra: u64 },
    #[error("bad frame magic {given:02x?}")]
    BadMagic { given: [u8; 4] },
    #[error("unsupported frame version {given}, this build speaks version {supported}")]
    UnsupportedVersion { given: u16, supported: u16 },
    #[error("frame header length {header_bytes} outside {min}..={max}")]
    HeaderLength {
        header_bytes: u64,
        min: u64,
        max: u64,
    },
    #[error(
        "frame header checksum mismatch: header says {expected:#010x}, computed {actual:#010x}"
    )]
    HeaderChecksumMismatch { expected: u32, actual: u32 },
    #[error("xfer {xfer_id} layer {layer}: invalid header field {field}: {reason}")]
    InvalidHeader {
        xfer_id: TransferId,
        layer: u32,
        field: &'static str,
        reason: String,
    },
    #[error("xfer {xfer_id} layer {layer}: payload of {payload_bytes} bytes exceeds the limit of {limit} bytes")]
    PayloadTooLarge {
        xfer_id: TransferId,
        layer: u32,
        payload_bytes: u64,
        limit: u64,
    },
    #[error("xfer {xfer_id} layer {layer}: payload_len {payload_bytes} disagrees with the layout, which needs {expected} bytes for {num_blocks} blocks")]
    LayoutMismatch {
        xfer_id: TransferId,
        layer: u32,
        payload_bytes: u64,
        expected: u64,
        num_blocks: usize,
    },
    #[error("xfer {xfer_id} layer {layer}: payload checksum mismatch: header says {expected:#010x}, computed {actual:#010x}")]
    ChecksumMismatch {
        xfer_id: TransferId,
        layer: u32,
        expected: u32,
        actual: u32,
    },

    // ---- receiver-side admission ----------------------------------------------------------
    #[error("xfer {xfer_id} is not registered on this node")]
    UnknownTransfer { xfer_id: TransferId },
    #[error("xfer {xfer_id} epoch {epoch}: the reservation is bound to another prefill node")]
    WrongPeer { xfer_id: TransferId, epoch: u64 },
    #[error(
        "xfer {xfer_id}: frame epoch {epoch} is ahead of the registered epoch {registered_epoch}"
    )]
    EpochAhead {
        xfer_id: TransferId,
        epoch: u64,
        registered_epoch: u64,
    },
    #[error("xfer {xfer_id}: epoch {epoch} is not newer than the known epoch {known_epoch}")]
    EpochNotNewer {
        xfer_id: TransferId,
        epoch: u64,
        known_epoch: u64,
    },
    #[error("xfer {xfer_id} layer {layer}: block_ids differ from the reservation ({given} given, {reserved} reserved)")]
    BlockIdsMismatch {
        xfer_id: TransferId,
        layer: u32,
        given: usize,
        reserved: usize,
    },
    #[error("xfer {xfer_id} layer {layer}: {field} differs from the reservation: reserved {reserved}, given {given}")]
    ReservationMismatch {
        xfer_id: TransferId,
        layer: u32,
        field: &'static str,
        reserved: String,
        given: String,
    },
    #[error("xfer {xfer_id}: layer {layer} out of range, the reservation has {num_layers} layers")]
    LayerOutOfRange {
        xfer_id: TransferId,
        layer: u32,
        num_layers: u32,
    },
    #[error("xfer {xfer_id}: layer {layer} was already received or is being received")]
    DuplicateLayer { xfer_id: TransferId, layer: u32 },
    #[error("xfer {xfer_id}: invalid reservation: {reason}")]
    InvalidReservation { xfer_id: TransferId, reason: String },
    #[error("xfer {xfer_id} was deregistered")]
    TransferClosed { xfer_id: TransferId },
    #[error(
        "xfer {xfer_id}: {layers_received} of {num_layers} layers after timeout_ms {timeout_ms}"
    )]
    Timeout {
        xfer_id: TransferId,
        timeout_ms: u64,
        layers_received: u32,
        num_layers: u32,
    },
    #[error("xfer {xfer_id} layer {layer}: sink failed: {reason}")]
    Sink {
        xfer_id: TransferId,
        layer: u32,
        reason: String,
    },

    // ---- sender side ----------------------------------------------------------------------
    #[error("xfer {xfer_id} layer {layer}: {endpoint} answered {verdict}")]
    Rejected {
        xfer_id: TransferId,
        layer: u32,
        endpoint: String,
        verdict: Verdict,
    },
    #[error("invalid kv endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error("connect to {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("quic connection to {endpoint}: {source}")]
    Connection {
        endpoint: String,
        #[source]
        source: quinn::ConnectionError,
    },
    #[error("{endpoint}: {what}: {source}")]
    Io {
        endpoint: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{endpoint}: {what}: {reason}")]
    Stream {
        endpoint: String,
        what: &'static str,
        reason: String,
    },

    // ---- set-up ---------------------------------------------------------------------------
    #[error("tls: {what}: {reason}")]
    Tls { what: &'static str, reason: String },
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error("{path}: {source}")]
    File {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("bind {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("invalid config: {field}: {reason}")]
    Config { field: &'static str, reason: String },
}

impl KvTransferError {
    /// The code a receiver answers with when this error ends a frame.
    pub fn verdict(&self) -> Verdict {
        match self {
            Self::UnknownTransfer { .. } => Verdict::UnknownTransfer,
            Self::WrongPeer { .. } => Verdict::WrongPeer,
            Self::TransferClosed { .. } => Verdict::TransferClosed,
            Self::EpochAhead { .. } => Verdict::EpochAhead,
            Self::BlockIdsMismatch { .. } => Verdict::BlockIdsMismatch,
            Self::ReservationMismatch { .. } | Self::LayoutMismatch { .. } => {
                Verdict::LayoutMismatch
            }
            Self::LayerOutOfRange { .. } => Verdict::LayerOutOfRange,
            Self::DuplicateLayer { .. } => Verdict::DuplicateLayer,
            Self::ChecksumMismatch { .. } => Verdict::ChecksumMismatch,
            Self::PayloadTooLarge { .. } => Verdict::TooLarge,
            Self::Sink { .. } => Verdict::SinkFailed,
            Self::Rejected { verdict, .. } => *verdict,
            _ => Verdict::Malformed,
        }
    }

    /// Stable snake_case name of the variant, for `proto`'s error table and metrics labels.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::TrailingBytes { .. } => "trailing_bytes",
            Self::BadMagic { .. } => "bad_magic",
            Self::UnsupportedVersion { .. } => "unsupported_version",
            Self::HeaderLength { .. } => "header_length",
            Self::HeaderChecksumMismatch { .. } => "header_checksum_mismatch",
            Self::InvalidHeader { .. } => "invalid_header",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::LayoutMismatch { .. } => "layout_mismatch",
            Self::ChecksumMismatch { .. } => "checksum_mismatch",
            Self::UnknownTransfer { .. } => "unknown_transfer",
            Self::WrongPeer { .. } => "wrong_peer",
            Self::EpochAhead { .. } => "epoch_ahead",
            Self::EpochNotNewer { .. } => "epoch_not_newer",
            Self::BlockIdsMismatch { .. } => "block_ids_mismatch",
            Self::ReservationMismatch { .. } => "reservation_mismatch",
            Self::LayerOutOfRange { .. } => "layer_out_of_range",
            Self::DuplicateLayer { .. } => "duplicate_layer",
            Self::InvalidReservation { .. } => "invalid_reservation",
            Self::TransferClosed { .. } => "transfer_closed",
            Self::Timeout { .. } => "timeout",
            Self::Sink { .. } => "sink",
            Self::Rejected { .. } => "rejected",
            Self::InvalidEndpoint { .. } => "invalid_endpoint",
            Self::Connect { .. } => "connect",
            Self::Connection { .. } => "connection",
            Self::Io { .. } => "io",
            Self::Stream { .. } => "stream",
            Self::Tls { .. } | Self::Identity(_) => "tls",
            Self::File { .. } => "file",
            Self::Bind { .. } => "bind",
            Self::Config { .. } => "config",
        }
    }
}
