//! Errors of node start-up and serving, each mapped to the error table.

use proto::ErrorCode;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    #[error(transparent)]
    Engine(#[from] engine::error::EngineError),
    #[error(transparent)]
    KvTransfer(#[from] kvtransfer::KvTransferError),
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error("io error on {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("grpc transport error: {0}")]
    Grpc(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("the engine thread has stopped")]
    EngineStopped,
}

impl NodeError {
    pub fn code(&self) -> ErrorCode {
        use engine::error::EngineError as E;
        match self {
            NodeError::Engine(E::OutOfBlocks { .. }) => ErrorCode::Overloaded,
            NodeError::Engine(E::PromptTooLong { .. }) => ErrorCode::InputTooLong,
            NodeError::Engine(E::InvalidParameter { .. } | E::DuplicateSequence { .. }) => {
                ErrorCode::Validation
            }
            NodeError::Engine(E::UnknownSequence(_)) => ErrorCode::NotFound,
            NodeError::KvTransfer(_) => ErrorCode::KvTransfer,
            NodeError::EngineStopped => ErrorCode::Unavailable,
            _ => ErrorCode::Internal,
        }
    }

    pub fn to_status(&self) -> tonic::Status {
        self.code().status(self.to_string())
    }
}
