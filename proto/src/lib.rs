//! proto: placeholder until its issue lands.
