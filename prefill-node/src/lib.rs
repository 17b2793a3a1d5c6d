//! prefill-node: placeholder until its issue lands.
