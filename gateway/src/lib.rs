//! gateway: placeholder until its issue lands.
