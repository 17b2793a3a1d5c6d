//! The wire protocol's version, which every frame and every verdict carries. It sits in a
//! file of its own, below both, so that the frame format and the verdict that answers it need
//! not import each other.

/// The version of the frame format and of the verdicts that answer it.
pub const VERSION: u16 = 1;
