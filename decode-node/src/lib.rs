//! decode-node: placeholder until its issue lands.
