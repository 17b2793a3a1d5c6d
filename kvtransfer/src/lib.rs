//! kvtransfer: placeholder until its issue lands.
