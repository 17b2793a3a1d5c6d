//! Several "hosts" on one machine: each a network namespace with its own address on a private
//! subnet, joined by a bridge that lives in a namespace of its own. Nothing is added to the
//! machine's own network, and no packet leaves the namespaces; dropping the [`Lab`] kills what
//! runs in them and removes them. Needs root (`ip netns`, from iproute2).

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

/// The private subnet every lab uses: its namespaces are its own, so labs never meet.
const SUBNET: [u8; 3] = [10, 233, 0];

/// A set of hosts on one bridge.
pub struct Lab {
    bridge_ns: String,
    hosts: Vec<Host>,
}

/// One host: a namespace with `eth0` at `ip`.
#[derive(Clone, Debug)]
pub struct Host {
    pub name: String,
    pub ns: String,
    pub ip: Ipv4Addr,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn ns_path(ns: &str) -> String {
    format!("/var/run/netns/{ns}")
}

/// Moves the calling thread onto the network namespace at `path`.
fn enter_path(path: &str) -> Result<(), String> {
    let ns = std::fs::File::open(path).map_err(|e| format!("{path}: {e}"))?;
    // SAFETY: setns on a namespace file descriptor we own; it changes only this thread.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("setns {path}: {}", std::io::Error::last_os_error()))
    }
}

impl Lab {
    /// A lab with one host per name, at 10.233.0.2, .3, ... in order. `Err` says why
    /// namespaces cannot be made here (not root, no iproute2, no permission).
    pub fn new(names: &[&str]) -> Result<Lab, String> {
        // Unique per lab, so that two at once (two tests of one binary) never share a name.
        static LABS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = LABS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let prefix = format!("fx{}-{n}", std::process::id());
        let bridge_ns = format!("{prefix}-br");
        let mut lab = Lab {
            bridge_ns: bridge_ns.clone(),
            hosts: Vec::new(),
        };
        ip(&["netns", "add", &bridge_ns])?;
        ip(&["-n", &bridge_ns, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &bridge_ns, "link", "set", "br0", "up"])?;
        for (i, name) in names.iter().enumerate() {
            let host = Host {
                name: name.to_string(),
                ns: format!("{prefix}-{name}"),
                ip: Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], 2 + i as u8),
            };
            // Pushed first so that a failure below still removes it.
            lab.hosts.push(host.clone());
            let ns = host.ns.as_str();
            let port = format!("v{i}");
            ip(&["netns", "add", ns])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n", &bridge_ns, "link", "add", &port, "type", "veth", "peer", "name", "eth0",
                "netns", ns,
            ])?;
            ip(&["-n", &bridge_ns, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &bridge_ns, "link", "set", &port, "up"])?;
            let cidr = format!("{}/24", host.ip);
            ip(&["-n", ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
        }
        Ok(lab)
    }

    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name} in the lab"))
    }

    /// `program` to run on `host`.
    pub fn command(&self, host: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.host(host).ns])
            .arg(program);
        cmd
    }

    /// Moves the calling thread (and the threads it starts from now on) onto `host`: its
    /// sockets, a test's HTTP clients included, then reach the lab's addresses.
    pub fn enter(&self, host: &str) -> Result<(), String> {
        enter_path(&ns_path(&self.host(host).ns))
    }

    /// Makes `to`'s loopback `port` reachable on `from`'s loopback at the same port: a thread
    /// accepts on `from` and dials on `to`, copying bytes both ways, until the process exits.
    /// For a service that listens on loopback only (`fission up`'s etcd) and a client on
    /// another host that must reach it by the address it was given. No packet leaves the two
    /// namespaces: a socket stays in the namespace that made it, whichever thread uses it.
    pub fn forward_loopback(&self, from: &str, to: &str, port: u16) -> Result<(), String> {
        let (from_ns, to_ns) = (ns_path(&self.host(from).ns), ns_path(&self.host(to).ns));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let listener = enter_path(&from_ns).and_then(|()| {
                std::net::TcpListener::bind(("127.0.0.1", port))
                    .map_err(|e| format!("bind 127.0.0.1:{port} on {from_ns}: {e}"))
            });
            // Dials from here on leave from `to`; the listener stays on `from`.
            let listener = listener.and_then(|l| enter_path(&to_ns).map(|()| l));
            let listener = match listener {
                Ok(l) => {
                    let _ = tx.send(Ok(()));
                    l
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            for client in listener.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
                    continue;
                };
                for (mut a, mut b) in [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ]
                .into_iter()
                .filter_map(|(a, b)| a.ok().zip(b.ok()))
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut a, &mut b);
                        let _ = b.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        rx.recv()
            .map_err(|_| "the forwarding thread ended".to_string())?
    }

    /// Cuts `host`'s link at the bridge (a pulled cable: its packets vanish, nothing is reset).
    pub fn cut(&self, host: &str) {
        ip(&[
            "-n",
            &self.bridge_ns,
            "link",
            "set",
            &self.port(host),
            "down",
        ])
        .expect("the bridge port goes down");
    }

    /// Plugs `host`'s link back in.
    pub fn restore(&self, host: &str) {
        ip(&["-n", &self.bridge_ns, "link", "set", &self.port(host), "up"])
            .expect("the bridge port comes up");
    }

    fn port(&self, host: &str) -> String {
        let i = self
            .hosts
            .iter()
            .position(|h| h.name == host)
            .unwrap_or_else(|| panic!("no host {host} in the lab"));
        format!("v{i}")
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let namespaces = self
            .hosts
            .iter()
            .map(|h| h.ns.clone())
            .chain(std::iter::once(self.bridge_ns.clone()));
        for ns in namespaces {
            // Whatever still runs in it dies with it, and its interfaces go.
            if let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    // Not this process, which is listed once a thread of it entered a host.
                    if let Ok(pid) = pid.parse::<i32>().map_err(drop).and_then(|p| {
                        if p as u32 == std::process::id() {
                            Err(())
                        } else {
                            Ok(p)
                        }
                    }) {
                        // SAFETY: signalling a pid that `ip netns pids` listed in our namespace.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            }
            let _ = ip(&["netns", "del", &ns]);
        }
    }
}

/// A lab of `names`, or `None` after a `SKIPPED` line where namespaces cannot be made here;
/// panics instead where the tools are required (`FISSION_REQUIRE_TEST_TOOLS=1`).
pub fn lab_or_skip(names: &[&str]) -> Option<Lab> {
    match Lab::new(names) {
        Ok(lab) => Some(lab),
        Err(why) if !crate::phoenix::tools_required() => {
            eprintln!(
                "SKIPPED: network namespaces cannot be made here ({why}); run as root with iproute2"
            );
            None
        }
        Err(why) => panic!("network namespaces are required (FISSION_REQUIRE_TEST_TOOLS=1): {why}"),
    }
}

/// Starts `cmd` with its stderr in the file `log` (its stdin and stdout closed); killed on drop.
pub fn spawn_logged(mut cmd: Command, log: &std::path::Path) -> crate::fission::KillOnDrop {
    let stderr = std::fs::File::create(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    crate::fission::KillOnDrop(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}")),
    )
}

impl Lab {
    /// etcd on `host`, listening on its address, with its data and log under `dir`: the
    /// process and its client URL.
    pub fn start_etcd(
        &self,
        host: &str,
        dir: &std::path::Path,
    ) -> (crate::fission::KillOnDrop, String) {
        let url = format!("http://{}:2379", self.host(host).ip);
        let mut etcd = self.command(host, "etcd");
        etcd.arg("--data-dir")
            .arg(dir.join("etcd"))
            .args(["--listen-client-urls", &url])
            .args(["--advertise-client-urls", &url])
            .args(["--listen-peer-urls", "http://127.0.0.1:2380"]);
        (spawn_logged(etcd, &dir.join("etcd.log")), url)
    }
}
