//! The request id: the one name every process, log line and error uses for a request. Its own
//! module, beneath both the request types and the errors that name it.

use std::fmt;

/// The gateway's id for one request, unique per process (a UUID v4). Backends carry it to every
/// node that works on the request, and it is on every log line about it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestId(pub String);

impl RequestId {
    pub fn new_random() -> Self {
        Self(uuid::Uuid::new_v4().simple().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_unique() {
        assert_ne!(RequestId::new_random(), RequestId::new_random());
    }
}
