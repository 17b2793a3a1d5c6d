//! `fission node prefill|decode|start` and `fission gateway`: the services, run from the one
//! binary so `fission up` can start each as its own process. Each parses the same command line
//! as the service's own binary (`fission-prefill`, `fission-decode`, `fission-gateway`) and
//! runs it through the same launcher.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use decode_node::{DecodeConfig, DecodeNode};
use engine::loader::{ModelFiles, ModelSource};
use node_common::launch::{launch, NodeCli};
use prefill_node::{PrefillConfig, PrefillNode};

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Run a prefill node.
    Prefill(NodeCli<PrefillConfig>),
    /// Run a decode node.
    Decode(NodeCli<DecodeConfig>),
    /// Add a node to a running cluster: registers in etcd, on free ports unless told otherwise.
    /// Takes the flags of `fission node prefill|decode` after `--role` (`fission node start
    /// --role prefill -- --help` lists them).
    Start(StartArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum NodeRole {
    Prefill,
    Decode,
}

#[derive(Args)]
pub struct StartArgs {
    #[arg(long, value_enum)]
    role: NodeRole,
    /// The role's own flags (`--model DIR_OR_REPO`, `--etcd URL`, ...).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    rest: Vec<String>,
}

#[derive(Parser)]
struct Flags<C: Args> {
    #[command(flatten)]
    node: NodeCli<C>,
}

/// `rest` with free ports for every address it does not set: a node added at runtime must not
/// collide with the ones already running.
fn with_free_ports(role: NodeRole, rest: Vec<String>) -> Vec<String> {
    let mut argv = vec!["fission-node".to_string()];
    let has = |flag: &str| {
        rest.iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    let mut defaults = vec!["--grpc-addr", "--metrics-addr"];
    if matches!(role, NodeRole::Decode) {
        defaults.push("--kv-addr");
    }
    for flag in defaults {
        if !has(flag) {
            argv.push(format!("{flag}=127.0.0.1:0"));
        }
    }
    argv.extend(rest);
    argv
}

/// `start` joins a running cluster: without etcd the node would serve, unseen by any gateway,
/// and look healthy while it never gets a request.
fn require_etcd(etcd: &[String]) -> anyhow::Result<()> {
    if etcd.is_empty() {
        anyhow::bail!(
            "fission node start joins a cluster through etcd: pass --etcd URL (fission up prints it) or set FISSION_ETCD"
        );
    }
    Ok(())
}

/// Every role resolves `--model` itself (`stories260K` is the embedded default model; see
/// [`node_common::default_model`]), as its own binary does.
pub fn run_node(cmd: NodeCommand) -> anyhow::Result<()> {
    match cmd {
        NodeCommand::Prefill(cli) => launch::<PrefillNode>(cli)?,
        NodeCommand::Decode(cli) => launch::<DecodeNode>(cli)?,
        NodeCommand::Start(s) => {
            let argv = with_free_ports(s.role, s.rest);
            match s.role {
                NodeRole::Prefill => {
                    let cli = Flags::<PrefillConfig>::parse_from(argv).node;
                    require_etcd(&cli.config.node.cluster.etcd)?;
                    launch::<PrefillNode>(cli)?
                }
                NodeRole::Decode => {
                    let cli = Flags::<DecodeConfig>::parse_from(argv).node;
                    require_etcd(&cli.config.node.cluster.etcd)?;
                    launch::<DecodeNode>(cli)?
                }
            }
        }
    }
    Ok(())
}

/// `fission gateway`: `--model-dir` takes what the nodes' `--model` takes, so one setting
/// (compose's `FISSION_MODEL`, the Kubernetes ConfigMap) serves both. A directory is used as it
/// is, `stories260K` is the embedded default, and a hub id (`org/name[@revision]`) is resolved
/// through the hub cache as the nodes resolve it; the gateway crate links no engine, so the bare
/// `fission-gateway` takes a directory only.
pub fn run_gateway(mut cli: gateway::cli::GatewayCli) -> anyhow::Result<()> {
    let spec = cli.args.model_dir.to_string_lossy().into_owned();
    let (dir, hub_id) = gateway_model(&crate::default_model::resolve(&spec)?)?;
    cli.args.model_dir = dir;
    if cli.args.model_id.is_none() {
        // The nodes name a hub model by its repo id; the snapshot folder is a commit hash.
        cli.args.model_id = hub_id;
    }
    Ok(gateway::cli::launch(cli)?)
}

/// The directory the gateway reads the tokenizer and weights from, and the repo id when
/// `spec` is a hub id. The whole model is fetched: the gateway's fingerprint of the weights
/// pins the cluster's model.
fn gateway_model(spec: &str) -> anyhow::Result<(PathBuf, Option<String>)> {
    let source = ModelSource::parse(spec);
    // A GGUF file resolves as the nodes resolve it, to the model directory written for it in
    // the cache (its config, tokenizer and chat template), named after the file's stem.
    let gguf = match &source {
        ModelSource::Local(p) => p
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf")),
        _ => false,
    };
    if matches!(source, ModelSource::Local(_)) && !gguf {
        return Ok((PathBuf::from(spec), None));
    }
    let files = ModelFiles::resolve(&source).with_context(|| {
        format!("--model-dir {spec}: not a directory here, so read as a hub id")
    })?;
    let dir = files
        .config
        .parent()
        .context("config.json has a parent directory")?
        .to_path_buf();
    Ok((dir, (!gguf).then(|| source.model_id())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser)]
    struct Gateway {
        #[command(flatten)]
        cli: gateway::cli::GatewayCli,
    }

    /// The nodes' `--max-input-tokens` and `--max-total-tokens` default to the gateway's
    /// limits ([`gateway::GatewayConfig::default`]), which its flags read.
    #[test]
    fn nodes_and_gateway_default_to_the_same_token_limits() {
        let node = Flags::<PrefillConfig>::try_parse_from(["fission-prefill", "--model", "m"])
            .unwrap()
            .node
            .config
            .node
            .engine;
        let gateway = gateway::GatewayConfig::default();
        assert_eq!(
            (node.max_input_tokens, node.max_total_tokens),
            (gateway.max_input_tokens, gateway.max_total_tokens)
        );
        let flags = Gateway::try_parse_from(["fission-gateway", "--model-dir", "m", "--etcd", "e"])
            .unwrap()
            .cli
            .args;
        assert_eq!(
            (flags.max_input_tokens, flags.max_total_tokens),
            (gateway.max_input_tokens, gateway.max_total_tokens)
        );
    }

    /// A GGUF file is read by the gateway as the nodes read it: the model directory written
    /// for it (config, tokenizer, chat template), not the file itself.
    #[test]
    fn the_gateway_reads_a_gguf_file_through_its_model_directory() {
        let file = ::random_model::gguf_out::fixtures::path("stories260K-f32.gguf");
        let (dir, id) = gateway_model(file.to_str().unwrap()).unwrap();
        assert!(dir.is_dir(), "{}", dir.display());
        assert!(dir.join("config.json").is_file());
        assert!(dir.join("tokenizer.json").is_file());
        assert_eq!(id, None);
    }
}
