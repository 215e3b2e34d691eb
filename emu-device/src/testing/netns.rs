//! Network namespaces as hosts for fabric tests: each namespace has its
//! own IPv4 address on a bridge, so device processes started in them
//! ([`DeviceProcess::start_in_netns`](super::DeviceProcess::start_in_netns))
//! talk real UDP through real interfaces, while their unix sockets stay in
//! the shared filesystem for driver processes of the root namespace.
//!
//! Layout for `count` hosts of a set named `pindown-hosts-PID-N`:
//!
//! ```text
//!  pindown-hosts-PID-N-0 (eth0 10.201.0.1/24) --veth--+
//!  pindown-hosts-PID-N-1 (eth0 10.201.0.2/24) --veth--+-- br0 in pindown-hosts-PID-N-br
//!  ...                                          |
//! ```
//!
//! The bridge lives in a namespace of its own, so the root namespace's
//! interfaces and routes are never touched; deleting the namespaces (on
//! drop, also while a test panics) deletes everything. Sets left behind by
//! test processes that were killed are deleted by the next
//! [`NetworkNamespaces::create`].
//!
//! Creating namespaces needs root (`CAP_SYS_ADMIN` and `CAP_NET_ADMIN`)
//! and iproute2's `ip`; [`NetworkNamespaces::unavailable`] says why they
//! cannot be had.

use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where `ip netns` keeps its named namespaces.
pub const NETNS_DIR: &str = "/run/netns";

/// The prefix of every namespace these tests create.
const PREFIX: &str = "pindown-hosts-";

static SETS: AtomicUsize = AtomicUsize::new(0);

/// One namespace of a set: a host with one address.
#[derive(Debug, Clone)]
pub struct Namespace {
    name: String,
    address: Ipv4Addr,
}

impl Namespace {
    /// The name `ip netns` knows it by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its address on the set's bridge.
    pub fn address(&self) -> Ipv4Addr {
        self.address
    }

    /// The file that holds it (what `setns(2)` opens).
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }
}

/// A set of network namespaces joined by a bridge, deleted on drop.
#[derive(Debug)]
pub struct NetworkNamespaces {
    hosts: Vec<Namespace>,
    bridge: String,
    /// Namespaces created so far (deleted on drop, bridge last).
    created: Vec<String>,
}

/// Runs `ip ARGS`, failing with its error output.
fn ip(args: &[&str]) -> io::Result<()> {
    let output = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    if output.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

impl NetworkNamespaces {
    /// Why namespaces cannot be created here, or `None` when they can
    /// (root and `ip` on the path).
    pub fn unavailable() -> Option<String> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Some("network namespaces need root".into());
        }
        if !on_path("ip") {
            return Some("network namespaces need iproute2's `ip` on the PATH".into());
        }
        None
    }

    /// Creates `count` (1 to 250) namespaces with loopback up, each with
    /// an `eth0` at `10.201.0.(i + 1)/24` on one bridge.
    pub fn create(count: usize) -> io::Result<NetworkNamespaces> {
        if !(1..=250).contains(&count) {
            return Err(io::Error::other(format!("{count} hosts: 1 to 250")));
        }
        if let Some(why) = Self::unavailable() {
            return Err(io::Error::other(why));
        }
        delete_orphans();
        let set = format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            SETS.fetch_add(1, Ordering::Relaxed)
        );
        let mut me = NetworkNamespaces {
            hosts: Vec::new(),
            bridge: format!("{set}-br"),
            created: Vec::new(),
        };
        ip(&["netns", "add", &me.bridge])?;
        me.created.push(me.bridge.clone());
        ip(&["-n", &me.bridge, "link", "set", "lo", "up"])?;
        ip(&["-n", &me.bridge, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &me.bridge, "link", "set", "br0", "up"])?;
        for i in 0..count {
            let host = Namespace {
                name: format!("{set}-{i}"),
                address: Ipv4Addr::new(10, 201, 0, i as u8 + 1),
            };
            ip(&["netns", "add", &host.name])?;
            me.created.push(host.name.clone());
            let port = format!("v{i}");
            ip(&[
                "link", "add", &port, "netns", &me.bridge, "type", "veth", "peer", "name", "eth0",
                "netns", &host.name,
            ])?;
            ip(&[
                "-n", &me.bridge, "link", "set", &port, "master", "br0", "up",
            ])?;
            let cidr = format!("{}/24", host.address);
            ip(&["-n", &host.name, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &host.name, "link", "set", "eth0", "up"])?;
            ip(&["-n", &host.name, "link", "set", "lo", "up"])?;
            me.hosts.push(host);
        }
        Ok(me)
    }

    /// The hosts.
    pub fn hosts(&self) -> &[Namespace] {
        &self.hosts
    }

    /// Host `i`.
    pub fn host(&self, i: usize) -> &Namespace {
        &self.hosts[i]
    }

    /// How many hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are none (never, once created).
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }
}

impl Drop for NetworkNamespaces {
    fn drop(&mut self) {
        // Hosts first: their veth ends go with them; the bridge last.
        for name in self.created.iter().rev() {
            if let Err(e) = ip(&["netns", "del", name]) {
                eprintln!("leaving network namespace {name}: {e}");
            }
        }
    }
}

/// Deletes namespaces of sets whose test process is gone.
fn delete_orphans() {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}
