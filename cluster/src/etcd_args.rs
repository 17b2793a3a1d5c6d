//! The etcd security flags, one definition for every process that talks to etcd: the nodes,
//! the gateway and `fission nodes` / `fission up`. Where etcd is (`--etcd`) stays with each
//! process, whose defaults differ.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;

use crate::error::ClusterError;
use crate::etcd_security::{EtcdClientCert, EtcdCredentials, EtcdPassword, EtcdSecurity, EtcdTls};

#[derive(Args, Debug, Clone, Default)]
pub struct EtcdSecurityArgs {
    /// CA certificate (PEM) that signed etcd's server certificate. Makes the connection TLS:
    /// give the endpoints as https:// URLs.
    #[arg(long, env = "FISSION_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an etcd started with --client-cert-auth.
    #[arg(long, env = "FISSION_ETCD_CERT")]
    pub etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "FISSION_ETCD_KEY")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user, for an etcd with authentication enabled.
    #[arg(long, env = "FISSION_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// The etcd user's password. On a command line it is visible to local users (`ps`):
    /// prefer FISSION_ETCD_PASSWORD or --etcd-password-file.
    #[arg(long, env = "FISSION_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<EtcdPassword>,
    /// A file holding the etcd user's password (a trailing newline is ignored).
    #[arg(long, env = "FISSION_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
}

impl EtcdSecurityArgs {
    /// TLS with `ca`, presenting the client certificate `cert` / `key`: what `fission up`
    /// gives the processes of a cluster on its own etcd.
    pub fn client_cert(ca: PathBuf, cert: PathBuf, key: PathBuf) -> Self {
        EtcdSecurityArgs {
            etcd_ca: Some(ca),
            etcd_cert: Some(cert),
            etcd_key: Some(key),
            ..EtcdSecurityArgs::default()
        }
    }

    /// The security the flags describe, with the password file read now.
    pub fn security(&self) -> Result<EtcdSecurity, ClusterError> {
        let invalid = |field, reason| ClusterError::InvalidConfig {
            field,
            reason,
            value: String::new(),
        };
        let client_cert = match (&self.etcd_cert, &self.etcd_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(EtcdClientCert {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => return Err(invalid("--etcd-cert", "and --etcd-key go together")),
        };
        let tls = match (&self.etcd_ca, client_cert) {
            (None, None) => None,
            (Some(ca), client_cert) => Some(EtcdTls {
                ca_cert: ca.clone(),
                client_cert,
            }),
            (None, Some(_)) => {
                return Err(invalid(
                    "--etcd-cert",
                    "needs --etcd-ca: a client certificate is only sent over TLS",
                ))
            }
        };
        let password = match (&self.etcd_password, &self.etcd_password_file) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "--etcd-password",
                    "and --etcd-password-file are exclusive: give one",
                ))
            }
            (Some(password), None) => Some(
                password
                    .clone()
                    .with_source(password_source(password, std::env::var(PASSWORD_ENV).ok())),
            ),
            (None, Some(path)) => Some(EtcdPassword::from_file(path)?),
            (None, None) => None,
        };
        let credentials = match (&self.etcd_user, password) {
            (None, None) => None,
            (Some(user), Some(password)) => Some(EtcdCredentials {
                user: user.clone(),
                password,
            }),
            (Some(_), None) => return Err(invalid(
                "--etcd-user",
                "needs a password: FISSION_ETCD_PASSWORD, --etcd-password-file or --etcd-password",
            )),
            (None, Some(_)) => {
                return Err(invalid("--etcd-password", "needs --etcd-user"));
            }
        };
        Ok(EtcdSecurity { tls, credentials })
    }

    /// The flags again, for a child process's command line. A password given by value is
    /// left out (argv is visible to every local user): pass it in the child's environment
    /// with [`EtcdSecurityArgs::password_env`].
    pub fn to_args(&self) -> Vec<OsString> {
        let mut out = Vec::new();
        let paths = [
            ("--etcd-ca", &self.etcd_ca),
            ("--etcd-cert", &self.etcd_cert),
            ("--etcd-key", &self.etcd_key),
            ("--etcd-password-file", &self.etcd_password_file),
        ];
        for (flag, path) in paths {
            if let Some(path) = path {
                out.push(flag.into());
                out.push(path.clone().into());
            }
        }
        if let Some(user) = &self.etcd_user {
            out.push("--etcd-user".into());
            out.push(user.into());
        }
        out
    }

    /// `FISSION_ETCD_PASSWORD` and the password, when one was given by value.
    pub fn password_env(&self) -> Option<(&'static str, &str)> {
        self.etcd_password
            .as_ref()
            .map(|p| (PASSWORD_ENV, p.expose()))
    }
}

/// Where a password given by value came from, `env` being `FISSION_ETCD_PASSWORD`'s value:
/// clap reads that variable and `--etcd-password` into the same field, and an error about the
/// password must name the one the operator set.
fn password_source(password: &EtcdPassword, env: Option<String>) -> &'static str {
    if env.is_some_and(|v| v == password.expose()) {
        PASSWORD_ENV
    } else {
        "--etcd-password"
    }
}

const PASSWORD_ENV: &str = "FISSION_ETCD_PASSWORD";

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[&str]) -> EtcdSecurityArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            etcd: EtcdSecurityArgs,
        }
        let argv = std::iter::once("test").chain(flags.iter().copied());
        <Cli as clap::Parser>::try_parse_from(argv)
            .expect("flags parse")
            .etcd
    }

    #[test]
    fn no_flags_is_plaintext_without_a_user() {
        let security = args(&[]).security().unwrap();
        assert!(security.tls.is_none() && security.credentials.is_none());
    }

    #[test]
    fn half_a_pair_is_refused_with_the_flag_named() {
        for (flags, expected) in [
            (&["--etcd-cert", "c.pem"][..], "--etcd-cert and --etcd-key"),
            (
                &["--etcd-cert", "c", "--etcd-key", "k"][..],
                "needs --etcd-ca",
            ),
            (&["--etcd-user", "fission"][..], "--etcd-user needs"),
            (&["--etcd-password", "pw"][..], "needs --etcd-user"),
            (
                &[
                    "--etcd-user",
                    "u",
                    "--etcd-password",
                    "pw",
                    "--etcd-password-file",
                    "f",
                ][..],
                "exclusive",
            ),
        ] {
            let err = args(flags).security().unwrap_err().to_string();
            assert!(err.contains(expected), "{flags:?}: {err}");
            assert!(!err.contains("pw"), "the password leaked: {err}");
        }
    }

    /// Issue 31: an authentication failure named `--etcd-password-file` when the password
    /// came from `FISSION_ETCD_PASSWORD`.
    #[test]
    fn the_password_knows_where_it_came_from() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("etcd-password");
        std::fs::write(&file, "from-file\n").unwrap();
        let file = file.display().to_string();
        let source = |flags: &[&str]| {
            let creds = args(flags).security().unwrap().credentials.unwrap();
            creds.password.source()
        };
        assert_eq!(
            source(&["--etcd-user", "u", "--etcd-password-file", &file]),
            "--etcd-password-file"
        );
        assert_eq!(
            source(&["--etcd-user", "u", "--etcd-password", "not-in-the-env"]),
            "--etcd-password"
        );
        // What clap reads from the environment (this process's is left alone: other tests
        // parse it).
        let given = EtcdPassword::from("s3cret".to_string());
        assert_eq!(password_source(&given, Some("s3cret".into())), PASSWORD_ENV);
        assert_eq!(password_source(&given, None), "--etcd-password");
        let error = ClusterError::EtcdAuth {
            user: "fission".into(),
            reason: "authentication failed, invalid user ID or password".into(),
            password_source: PASSWORD_ENV,
        }
        .to_string();
        assert!(error.contains("from FISSION_ETCD_PASSWORD"), "{error}");
        assert!(!error.contains("--etcd-password-file"), "{error}");
    }

    #[test]
    fn the_password_comes_from_its_file_and_stays_out_of_child_argv() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("etcd-password");
        std::fs::write(&file, "from-file\n").unwrap();
        let file = file.display().to_string();
        let from_file = args(&["--etcd-user", "fission", "--etcd-password-file", &file]);
        let creds = from_file.security().unwrap().credentials.unwrap();
        assert_eq!(
            (creds.user.as_str(), creds.password.expose()),
            ("fission", "from-file")
        );

        let inline = args(&[
            "--etcd-user",
            "fission",
            "--etcd-password",
            "s3cret",
            "--etcd-ca",
            "ca.pem",
        ]);
        let argv: Vec<String> = inline
            .to_args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(argv, ["--etcd-ca", "ca.pem", "--etcd-user", "fission"]);
        assert_eq!(
            inline.password_env(),
            Some(("FISSION_ETCD_PASSWORD", "s3cret"))
        );
        assert!(!format!("{inline:?}").contains("s3cret"));
    }
}
