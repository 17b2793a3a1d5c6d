//! Certificates for tests that start processes themselves instead of `fission up`: one CA,
//! and a certificate per process for its role, as flags to append to its command line.

use std::path::{Path, PathBuf};

use identity::{generate_dev_ca, write_pem_files, Ca, PeerRole};

pub struct TestCerts {
    ca: Ca,
    dir: PathBuf,
}

impl TestCerts {
    /// A fresh CA whose files go under `dir`.
    pub fn new(dir: &Path) -> TestCerts {
        let dir = dir.join("tls");
        std::fs::create_dir_all(&dir).expect("tls dir");
        TestCerts {
            ca: generate_dev_ca().expect("dev CA"),
            dir,
        }
    }

    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// `--tls-ca A --tls-cert B --tls-key C` for a process `name` of `role`.
    pub fn flags(&self, role: PeerRole, name: &str) -> Vec<String> {
        let cert = self.ca.issue(role, name).expect("issue a certificate");
        let files = write_pem_files(&self.dir, &self.ca, &cert).expect("write the certificate");
        [
            ("--tls-ca", files.ca_cert),
            ("--tls-cert", files.cert),
            ("--tls-key", files.key),
        ]
        .into_iter()
        .flat_map(|(flag, path)| [flag.to_string(), path.display().to_string()])
        .collect()
    }
}
