//! The cluster CA and the role certificates it issues.
//!
//! `fission up` calls [`generate_dev_ca`] and [`Ca::issue`] and writes the PEMs with
//! [`write_pem_files`]; `fission certs` does the same from an operator's CA
//! ([`Ca::from_pem`]). Production may use any CA tooling instead, as long as each certificate
//! carries its role's URI ([`PeerRole::uri`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use rcgen::string::Ia5String;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::error::{tls_err, IdentityError};
use crate::role::PeerRole;

/// A cluster certificate authority that can issue role certificates.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    key_pem: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// A certificate and its private key, PEM encoded.
#[derive(Clone)]
pub struct RoleCert {
    pub name: String,
    pub role: PeerRole,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for RoleCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoleCert")
            .field("name", &self.name)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// Creates a self-signed CA with a fresh ECDSA P-256 key, for development clusters.
pub fn generate_dev_ca() -> Result<Ca, IdentityError> {
    let mut params = CertificateParams::new(Vec::<String>::new())
        .map_err(|e| tls_err("ca params")(e.to_string()))?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(DnType::CommonName, "fission dev cluster CA");
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().map_err(|e| tls_err("ca key")(e.to_string()))?;
    let cert = params
        .self_signed(&key)
        .map_err(|e| tls_err("self-sign ca")(e.to_string()))?;
    let key_pem = key.serialize_pem();
    Ok(Ca {
        cert_pem: cert.pem(),
        key_pem,
        issuer: Issuer::new(params, key),
    })
}

impl Ca {
    /// An existing CA from its certificate and private key.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, IdentityError> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| tls_err("ca key")(e.to_string()))?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)
            .map_err(|e| tls_err("ca certificate")(e.to_string()))?;
        Ok(Ca {
            issuer,
            cert_pem: cert_pem.to_owned(),
            key_pem: key_pem.to_owned(),
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// Issues `name` a certificate for `role`, usable as TLS server and client. Besides the
    /// name it names `localhost`, `127.0.0.1` and `::1`, so a one-machine dev cluster can dial
    /// loopback addresses; use [`Ca::issue_with_sans`] to choose the names exactly.
    pub fn issue(&self, role: PeerRole, name: &str) -> Result<RoleCert, IdentityError> {
        let sans = [
            name.to_owned(),
            "localhost".to_owned(),
            IpAddr::V4(Ipv4Addr::LOCALHOST).to_string(),
            IpAddr::V6(Ipv6Addr::LOCALHOST).to_string(),
        ];
        self.issue_with_sans(role, name, &sans)
    }

    /// Issues `name` a certificate for `role` whose DNS and IP names are exactly `sans`.
    pub fn issue_with_sans(
        &self,
        role: PeerRole,
        name: &str,
        sans: &[String],
    ) -> Result<RoleCert, IdentityError> {
        let mut params = CertificateParams::new(sans.to_vec())
            .map_err(|e| tls_err("cert params")(format!("{name}: {e}")))?;
        let uri = Ia5String::try_from(role.uri())
            .map_err(|e| tls_err("role uri")(format!("{name}: {e}")))?;
        params.subject_alt_names.push(SanType::URI(uri));
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().map_err(|e| tls_err("key")(e.to_string()))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| tls_err("sign cert")(format!("{name}: {e}")))?;
        Ok(RoleCert {
            name: name.to_owned(),
            role,
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// Paths of the three PEM files a process needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_cert: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Writes `ca.pem`, `<name>.pem` and `<name>.key` (mode 0600 on Unix) into `dir`.
pub fn write_pem_files(dir: &Path, ca: &Ca, cert: &RoleCert) -> Result<TlsFiles, IdentityError> {
    let write = |path: PathBuf, contents: &str, private: bool| {
        let io = |source| IdentityError::File {
            path: path.display().to_string(),
            source,
        };
        // Children may be reading a shared file (ca.pem) already: never rewrite it in place
        // when it holds the same bytes, and otherwise replace it atomically.
        if std::fs::read_to_string(&path).is_ok_and(|c| c == contents) {
            return Ok(path);
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, contents).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        #[cfg(unix)]
        if private {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
        }
        #[cfg(not(unix))]
        let _ = private;
        Ok::<_, IdentityError>(path)
    };
    Ok(TlsFiles {
        ca_cert: write(dir.join("ca.pem"), ca.cert_pem(), false)?,
        cert: write(
            dir.join(format!("{}.pem", cert.name)),
            &cert.cert_pem,
            false,
        )?,
        key: write(dir.join(format!("{}.key", cert.name)), &cert.key_pem, true)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::TlsIdentity;

    #[test]
    fn issued_certificates_carry_their_role() {
        let ca = generate_dev_ca().unwrap();
        for role in PeerRole::ALL {
            let cert = ca.issue(role, &format!("{role}-0")).unwrap();
            let id = TlsIdentity::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem).unwrap();
            assert_eq!(id.role(), Some(role));
        }
    }

    #[test]
    fn a_ca_loaded_from_pem_issues_certificates_the_original_trusts() {
        let ca = generate_dev_ca().unwrap();
        let again = Ca::from_pem(ca.cert_pem(), ca.key_pem()).unwrap();
        let cert = again.issue(PeerRole::Admin, "ops").unwrap();
        let id = TlsIdentity::from_pem(ca.cert_pem(), &cert.cert_pem, &cert.key_pem).unwrap();
        assert_eq!(id.role(), Some(PeerRole::Admin));
    }

    #[test]
    fn pem_files_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_dev_ca().unwrap();
        let cert = ca.issue(PeerRole::Prefill, "prefill-0").unwrap();
        let files = write_pem_files(dir.path(), &ca, &cert).unwrap();
        assert_eq!(files.key, dir.path().join("prefill-0.key"));
        let id = TlsIdentity::from_files(&files).unwrap();
        assert_eq!(id.role(), Some(PeerRole::Prefill));
    }
}
