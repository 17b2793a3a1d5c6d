//! A client-certificate verifier that, beyond the chain to the cluster CA, admits only
//! certificates of given roles. For a port that one role has any business on (a decode node's
//! KV receiver takes prefill nodes only): a member of another role fails the handshake, before
//! it can send a byte, instead of being refused frame by frame.

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::role::PeerRole;

#[derive(Debug)]
pub(crate) struct RoleVerifier {
    pub(crate) inner: Arc<dyn ClientCertVerifier>,
    pub(crate) roles: Vec<PeerRole>,
}

impl ClientCertVerifier for RoleVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        // The chain first: a role named by a certificate the CA did not sign means nothing.
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        match PeerRole::from_cert_der(end_entity) {
            Some(role) if self.roles.contains(&role) => Ok(verified),
            role => {
                tracing::warn!(
                    peer_role = role.map_or("none", PeerRole::as_str),
                    allowed = ?self.roles,
                    "client certificate refused: its role may not use this port"
                );
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::ApplicationVerificationFailure,
                ))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
