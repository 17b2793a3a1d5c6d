//! identity: who belongs to the cluster, and how every channel proves it.
//!
//! One cluster CA signs a certificate per process. Each certificate names its [`PeerRole`]
//! (gateway, prefill, decode, admin, etcd) in a subject-alternative-name URI
//! (`urn:fission:role:<role>`), so a server can decide per call what its peer may do. The same
//! identity serves every channel: the nodes' gRPC ([`GrpcSecurity`]), the KV transport's QUIC
//! (`kvtransfer` builds its quinn configs from [`TlsIdentity`]'s rustls configs) and etcd's
//! client certificates.
//!
//! `fission up` makes a dev CA ([`generate_dev_ca`]) and issues each process its certificate;
//! production passes PEM files ([`TlsArgs`]). Plaintext gRPC exists only behind an explicit
//! `--insecure`, for local development.
//!
//! This crate knows certificates and rustls/tonic configuration only: which role may call
//! which method is the servers' policy (`node_common::access`).

mod args;
mod ca;
mod error;
mod grpc;
mod role;
mod role_verifier;
mod tls;

pub use args::TlsArgs;
pub use ca::{generate_dev_ca, write_pem_files, Ca, RoleCert, TlsFiles};
pub use error::IdentityError;
pub use grpc::GrpcSecurity;
pub use role::PeerRole;
pub use tls::TlsIdentity;
