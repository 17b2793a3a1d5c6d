//! `fission certs init|issue`: a cluster CA and role certificates for operators who have no
//! CA tooling of their own. Any CA works, as long as each certificate carries its role's SAN
//! URI (`urn:fission:role:<role>`; see SECURITY.md).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Subcommand;
use identity::{generate_dev_ca, write_pem_files, Ca, PeerRole};

#[derive(Subcommand, Debug)]
pub enum CertsCommand {
    /// Create a cluster CA: `ca.pem` (give it to every process) and `ca.key` (keep it
    /// offline).
    Init {
        #[arg(long)]
        out: PathBuf,
    },
    /// Issue a certificate for one process: `<name>.pem` and `<name>.key` (plus `ca.pem`).
    Issue {
        #[arg(long)]
        ca_cert: PathBuf,
        #[arg(long)]
        ca_key: PathBuf,
        /// gateway, prefill, decode, admin or etcd.
        #[arg(long)]
        role: String,
        /// The certificate's common name, and its file names.
        #[arg(long)]
        name: String,
        /// DNS names or IP addresses peers dial it by, repeatable [default: the name,
        /// localhost, 127.0.0.1 and ::1].
        #[arg(long = "san")]
        sans: Vec<String>,
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(cmd: CertsCommand) -> anyhow::Result<()> {
    match cmd {
        CertsCommand::Init { out } => {
            std::fs::create_dir_all(&out)?;
            let ca = generate_dev_ca()?;
            let key = out.join("ca.key");
            if key.exists() {
                bail!("{} exists: not overwriting a CA key", key.display());
            }
            std::fs::write(out.join("ca.pem"), ca.cert_pem())?;
            std::fs::write(&key, ca.key_pem())?;
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
            }
            println!("wrote {0}/ca.pem and {0}/ca.key", out.display());
        }
        CertsCommand::Issue {
            ca_cert,
            ca_key,
            role,
            name,
            sans,
            out,
        } => {
            let Some(role) = PeerRole::parse(&role) else {
                bail!("unknown role {role}: gateway, prefill, decode, admin or etcd");
            };
            let read = |p: &PathBuf| {
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
            };
            let ca = Ca::from_pem(&read(&ca_cert)?, &read(&ca_key)?)?;
            let cert = if sans.is_empty() {
                ca.issue(role, &name)?
            } else {
                ca.issue_with_sans(role, &name, &sans)?
            };
            std::fs::create_dir_all(&out)?;
            let files = write_pem_files(&out, &ca, &cert)?;
            println!(
                "wrote {} and {} for role {role}",
                files.cert.display(),
                files.key.display()
            );
        }
    }
    Ok(())
}
