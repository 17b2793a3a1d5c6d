//! The dev CA a local cluster (`fission up`) runs on: one certificate per process, for its
//! role, plus shared ones for the nodes an operator adds later and for the operator's own
//! commands. Everything lives in the cluster's temporary directory and dies with it.

use std::path::{Path, PathBuf};

use anyhow::Context;
use identity::{generate_dev_ca, write_pem_files, Ca, PeerRole, TlsFiles};

pub struct DevCerts {
    ca: Ca,
    dir: PathBuf,
}

impl DevCerts {
    /// A fresh CA, its certificates to be written under `dir/tls`.
    pub fn create(dir: &Path) -> anyhow::Result<DevCerts> {
        let dir = dir.join("tls");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(DevCerts {
            ca: generate_dev_ca()?,
            dir,
        })
    }

    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// Issues `name` a certificate for `role` and writes its files.
    pub fn issue(&self, role: PeerRole, name: &str) -> anyhow::Result<TlsFiles> {
        Ok(write_pem_files(
            &self.dir,
            &self.ca,
            &self.ca.issue(role, name)?,
        )?)
    }
}

/// `--tls-ca A --tls-cert B --tls-key C`, for a command line a user can copy.
pub fn tls_flags(files: &TlsFiles) -> String {
    format!(
        "--tls-ca {} --tls-cert {} --tls-key {}",
        files.ca_cert.display(),
        files.cert.display(),
        files.key.display()
    )
}

/// The same flags as arguments for a child process.
pub fn tls_args(files: &TlsFiles) -> [std::ffi::OsString; 6] {
    [
        "--tls-ca".into(),
        files.ca_cert.clone().into(),
        "--tls-cert".into(),
        files.cert.clone().into(),
        "--tls-key".into(),
        files.key.clone().into(),
    ]
}
