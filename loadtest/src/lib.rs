//! loadtest: placeholder until its issue lands.
