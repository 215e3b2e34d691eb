//! # Bootstrap: joining a job started by an existing launcher
//!
//! Every rank calls [`Job::from_environment`] first. It finds out which
//! launcher started the process, learns this rank's number and the job's
//! size, and gives access to the launcher's key-value space, through
//! which ranks exchange their device addresses ([`Job::all_gather`]).
//! pindown never starts ranks itself.
//!
//! ## Launchers, in the order they are detected
//!
//! | launcher | how ranks are started | variables read |
//! |---|---|---|
//! | [`Launcher::Hydra`]: a PMI-1 process manager | `mpiexec.hydra -n 4 ./app` (Debian's `mpich`: `mpiexec.mpich`); Slurm's `srun --mpi=pmi2 -n 4 ./app` serves the same PMI-1 wire protocol | `PMI_FD` (the inherited socket to the process manager), `PMI_RANK`, `PMI_SIZE`; or `PMI_PORT` (`host:port`) with `PMI_ID` (or `PMI_RANK` and `PMI_SIZE`); `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` (Hydra) for the local rank |
//! | [`Launcher::OpenMpi`]: Open MPI's `mpirun` | `mpirun.openmpi -n 4 ./app` (as root add `--allow-run-as-root`, on fewer cores `--oversubscribe`) | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`; the key-value space is the launcher's PMIx server (the `PMIX_*` variables it sets), reached through `libpmix.so.2` loaded at run time |
//! | [`Launcher::Pmix`]: any other PMIx server | `srun --mpi=pmix`, `prterun` | `PMIX_NAMESPACE`, `PMIX_RANK`; size and local rank from the server |
//! | [`Launcher::Environment`]: anything else | whatever starts the processes sets the variables | `PINDOWN_RANK`, `PINDOWN_SIZE`, `PINDOWN_KV_DIR` (a directory every rank can reach, empty at the start of each job, that holds the key-value space as files), optionally `PINDOWN_LOCAL_RANK`, `PINDOWN_LOCAL_SIZE` |
//! | [`Launcher::Single`] | started by hand, no variable above set | none: rank 0 of 1, the key-value space is local |
//!
//! `PINDOWN_LAUNCH_TIMEOUT` (seconds, default 300) bounds every wait for
//! the launcher: a reply of the process manager, a fence of the directory
//! space. `PINDOWN_PMIX_LIBRARY` names the PMIx library to load instead of
//! `libpmix.so.2`.
//!
//! A launcher that is present but broken is an error, never a silent
//! single-rank run: `PMI_FD` that is not an open socket, `PMI_RANK`
//! without `PMI_FD` or `PMI_PORT`, a rank not below the size, `OMPI_*`
//! variables while the PMIx library cannot be loaded or its server cannot
//! be reached, `PINDOWN_RANK` without `PINDOWN_SIZE`, a key-value space
//! that answers out of protocol: each gives a [`LaunchError`] that names
//! the variable, the command and the reply.
//!
//! ## Finding the host's device
//!
//! A rank reaches the device process of its own host. Ranks on one host
//! tell themselves apart by [`Job::local_rank`] (0 to
//! [`Job::local_size`] - 1, from the launcher's variables above), for
//! example to pick one port of the device each; the device's address is
//! what they then publish with [`Job::all_gather`].
//!
//! [`device_socket`] is that lookup, in this order:
//!
//! 1. `PINDOWN_DEVICE`: the path of the vhost-user socket of this rank's
//!    port (a wrapper script can set it per rank);
//! 2. `PINDOWN_DEVICE_DIR`: the device's socket directory (its
//!    `--socket-dir`): the rank takes `PINDOWN_DEVICE_DIR/port{L}.sock`,
//!    `L` its [`Job::local_rank`], so the ranks of one host use ports 0,
//!    1, ... of their host's device (the directory may also hold symbolic
//!    links to the sockets of other devices);
//! 3. neither: an error naming both variables (a missing local rank with
//!    `PINDOWN_DEVICE_DIR` also is one).
//!
//! ## Keys and values
//!
//! Keys are 1 to [`MAX_KEY_LEN`] characters from `A-Z a-z 0-9 _ - .`; every
//! rank has its own keys (rank 3's `addr` is not rank 5's). Values are
//! any bytes, up to [`MAX_VALUE_LEN`]: PMI-1 values, which are limited in
//! length and characters, are sent as hexadecimal split over as many keys
//! as needed.
//!
//! ```no_run
//! use pindown_driver::launch::Job;
//!
//! let mut job = Job::from_environment()?;
//! let my_address = format!("port{}", job.local_rank().unwrap_or(0));
//! let addresses = job.all_gather("addr", my_address.as_bytes())?;
//! assert_eq!(addresses.len(), job.size() as usize);
//! job.finalize()?;
//! # Ok::<(), pindown_driver::launch::LaunchError>(())
//! ```

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

mod env;
mod pmi1;
mod pmix;

/// The path of the vhost-user socket of this rank's device port:
/// `PINDOWN_DEVICE`, else `PINDOWN_DEVICE_DIR/port{local rank}.sock`
/// (see [Finding the host's device](self#finding-the-hosts-device)).
///
/// The path is not checked: opening the port
/// ([`Context::open`](crate::verbs::Context::open)) says whether a
/// device serves it.
pub fn device_socket(job: &Job) -> Result<PathBuf, LaunchError> {
    device_socket_from(&ProcessEnvironment, job)
}

/// [`device_socket`] with variables from `vars`.
pub(crate) fn device_socket_from(vars: &dyn Variables, job: &Job) -> Result<PathBuf, LaunchError> {
    if let Some(path) = vars.var("PINDOWN_DEVICE") {
        if path.is_empty() {
            return Err(LaunchError::Variable {
                variable: "PINDOWN_DEVICE".into(),
                reason: "is empty: it names the socket of this rank's device port".into(),
            });
        }
        return Ok(PathBuf::from(path));
    }
    if let Some(dir) = vars.var("PINDOWN_DEVICE_DIR") {
        if dir.is_empty() {
            return Err(LaunchError::Variable {
                variable: "PINDOWN_DEVICE_DIR".into(),
                reason: "is empty: it names the device's socket directory".into(),
            });
        }
        let local = job.local_rank().ok_or_else(|| LaunchError::Variable {
            variable: "PINDOWN_DEVICE_DIR".into(),
            reason: format!(
                "is set, but the {} launcher does not say this rank's local rank, \
                 which picks the port: set PINDOWN_DEVICE for each rank instead",
                job.launcher()
            ),
        })?;
        return Ok(PathBuf::from(dir).join(format!("port{local}.sock")));
    }
    Err(LaunchError::Variable {
        variable: "PINDOWN_DEVICE".into(),
        reason: "not set, nor PINDOWN_DEVICE_DIR: set PINDOWN_DEVICE to the socket of this \
                 rank's device port, or PINDOWN_DEVICE_DIR to the device's socket directory"
            .into(),
    })
}

/// The longest key [`Job::put`] takes.
pub const MAX_KEY_LEN: usize = 32;

/// The largest value [`Job::put`] takes (1 MiB).
pub const MAX_VALUE_LEN: usize = 1 << 20;

/// How long a wait for the launcher may take unless
/// `PINDOWN_LAUNCH_TIMEOUT` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Which launcher started this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// A PMI-1 process manager over `PMI_FD` or `PMI_PORT`: MPICH's Hydra
    /// (`mpiexec`), or Slurm's `srun --mpi=pmi2`.
    Hydra,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`), key-value space through
    /// its PMIx server.
    OpenMpi,
    /// Another PMIx server (`PMIX_NAMESPACE`, `PMIX_RANK` without Open
    /// MPI's variables).
    Pmix,
    /// `PINDOWN_RANK`, `PINDOWN_SIZE` and a shared directory
    /// `PINDOWN_KV_DIR`.
    Environment,
    /// No launcher: one rank.
    Single,
}

impl Launcher {
    /// A short name: `hydra`, `openmpi`, `pmix`, `environment`, `single`.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Hydra => "hydra",
            Launcher::OpenMpi => "openmpi",
            Launcher::Pmix => "pmix",
            Launcher::Environment => "environment",
            Launcher::Single => "single",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why joining the job, or an exchange through its key-value space, failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A launcher's variable is missing or malformed.
    #[error("{variable}: {reason}")]
    Variable {
        /// The variable (`PMI_FD`, `OMPI_COMM_WORLD_SIZE`, ...).
        variable: String,
        /// What is wrong with it, and its value.
        reason: String,
    },
    /// The PMI-1 process manager answered out of protocol, or with an error.
    #[error("PMI-1 command `{command}`: {reason} (reply: {reply:?})")]
    Protocol {
        /// The command sent.
        command: String,
        /// The reply line, as received (empty if none).
        reply: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Talking to the process manager failed (closed socket, timeout).
    #[error("PMI-1 command `{command}`: {source}")]
    Connection {
        /// The command being sent or answered.
        command: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The PMIx library could not be used (not installed, missing symbols).
    #[error("{launcher} started this process but its PMIx library cannot be used: {reason}")]
    PmixUnavailable {
        /// The launcher whose variables were found.
        launcher: Launcher,
        /// Why.
        reason: String,
    },
    /// A PMIx call failed.
    #[error("{call} failed: {status_name} ({status}){detail}")]
    Pmix {
        /// The call (`PMIx_Init`, `PMIx_Fence`, ...).
        call: String,
        /// Its status.
        status: i32,
        /// The library's name for the status.
        status_name: String,
        /// More about the call (the key, the rank).
        detail: String,
    },
    /// The environment key-value directory cannot be used.
    #[error("key-value directory {path}: {reason}")]
    Directory {
        /// The file or directory.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// Not every rank reached a fence in time.
    #[error("{what}: gave up after {waited:?}")]
    Timeout {
        /// What was waited for (with the ranks that were missing).
        what: String,
        /// How long.
        waited: Duration,
    },
    /// A key [`Job::put`] or [`Job::get`] cannot take.
    #[error("key {key:?}: {reason}")]
    InvalidKey {
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
    /// A value larger than [`MAX_VALUE_LEN`].
    #[error("value of key {key:?} is {len} bytes, more than {MAX_VALUE_LEN}")]
    ValueTooLarge {
        /// The key.
        key: String,
        /// The value's length.
        len: usize,
    },
    /// A rank outside the job.
    #[error("rank {rank} is not in the job of {size} ranks")]
    RankOutOfRange {
        /// The rank asked for.
        rank: u32,
        /// The job's size.
        size: u32,
    },
    /// The key was not published by that rank (or not yet fenced).
    #[error("rank {rank} published no key {key:?} (before the last fence){detail}")]
    NotFound {
        /// The rank.
        rank: u32,
        /// The key.
        key: String,
        /// What the launcher said.
        detail: String,
    },
    /// A published value that does not decode (another program's key, or
    /// a corrupted space).
    #[error("value of key {key:?} of rank {rank} is malformed: {reason}")]
    Malformed {
        /// The rank.
        rank: u32,
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
    /// The job was already finalized.
    #[error("the job was finalized")]
    Finalized,
}

/// The key-value space behind a job.
enum Space {
    Pmi1(pmi1::Client),
    Pmix(pmix::Client),
    Directory(env::DirectorySpace),
    Local(HashMap<String, Vec<u8>>),
}

/// This process's place in a job, and the job's key-value space.
///
/// Dropping a job finalizes it, best effort; [`Job::finalize`] reports
/// errors.
pub struct Job {
    rank: u32,
    size: u32,
    local: Option<(u32, u32)>,
    launcher: Launcher,
    space: Option<Space>,
}

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local", &self.local)
            .field("launcher", &self.launcher)
            .field("finalized", &self.space.is_none())
            .finish()
    }
}

/// Reads variables: the process environment, or a table in tests.
pub(crate) trait Variables {
    /// The variable's value, if set.
    fn var(&self, name: &str) -> Option<OsString>;
}

struct ProcessEnvironment;

impl Variables for ProcessEnvironment {
    fn var(&self, name: &str) -> Option<OsString> {
        std::env::var_os(name)
    }
}

impl<F: Fn(&str) -> Option<OsString>> Variables for F {
    fn var(&self, name: &str) -> Option<OsString> {
        self(name)
    }
}

/// A variable as UTF-8 text, `None` if unset.
pub(crate) fn text(vars: &dyn Variables, name: &str) -> Result<Option<String>, LaunchError> {
    match vars.var(name) {
        None => Ok(None),
        Some(value) => value
            .into_string()
            .map(Some)
            .map_err(|value| LaunchError::Variable {
                variable: name.into(),
                reason: format!("{value:?} is not UTF-8"),
            }),
    }
}

/// A variable holding a decimal `u32`, `None` if unset.
pub(crate) fn number(vars: &dyn Variables, name: &str) -> Result<Option<u32>, LaunchError> {
    let Some(value) = text(vars, name)? else {
        return Ok(None);
    };
    let trimmed = value.trim();
    if trimmed.is_empty() || !trimmed.bytes().all(|b| b.is_ascii_digit()) {
        return Err(LaunchError::Variable {
            variable: name.into(),
            reason: format!("{value:?} is not a non-negative decimal number"),
        });
    }
    trimmed
        .parse()
        .map(Some)
        .map_err(|_| LaunchError::Variable {
            variable: name.into(),
            reason: format!("{value:?} is too large"),
        })
}

/// A variable that must be set because `because` is.
pub(crate) fn required_number(
    vars: &dyn Variables,
    name: &str,
    because: &str,
) -> Result<u32, LaunchError> {
    number(vars, name)?.ok_or_else(|| LaunchError::Variable {
        variable: name.into(),
        reason: format!("not set, but {because} is: the launcher is broken or not fully set up"),
    })
}

/// Checks `rank < size` and `size > 0`, naming the variables.
pub(crate) fn check_rank(
    rank: u32,
    size: u32,
    rank_variable: &str,
    size_variable: &str,
) -> Result<(), LaunchError> {
    if size == 0 {
        return Err(LaunchError::Variable {
            variable: size_variable.into(),
            reason: "is 0: a job has at least one rank".into(),
        });
    }
    if rank >= size {
        return Err(LaunchError::Variable {
            variable: rank_variable.into(),
            reason: format!("rank {rank} is not below the job's size {size} ({size_variable})"),
        });
    }
    Ok(())
}

/// A local rank and size from a pair of variables, if both are set and
/// consistent.
fn local_pair(
    vars: &dyn Variables,
    rank_variable: &str,
    size_variable: &str,
) -> Result<Option<(u32, u32)>, LaunchError> {
    match (number(vars, rank_variable)?, number(vars, size_variable)?) {
        (Some(rank), Some(size)) => {
            check_rank(rank, size, rank_variable, size_variable)?;
            Ok(Some((rank, size)))
        }
        _ => Ok(None),
    }
}

/// The wait limit: `PINDOWN_LAUNCH_TIMEOUT` seconds or [`DEFAULT_TIMEOUT`].
fn timeout(vars: &dyn Variables) -> Result<Duration, LaunchError> {
    Ok(number(vars, "PINDOWN_LAUNCH_TIMEOUT")?
        .map(|seconds| Duration::from_secs(seconds.max(1).into()))
        .unwrap_or(DEFAULT_TIMEOUT))
}

/// Checks a user's key.
pub(crate) fn check_key(key: &str) -> Result<(), LaunchError> {
    let invalid = |reason: &str| LaunchError::InvalidKey {
        key: key.into(),
        reason: reason.into(),
    };
    if key.is_empty() {
        return Err(invalid("empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(invalid(&format!("longer than {MAX_KEY_LEN} bytes")));
    }
    if !key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return Err(invalid("only A-Z a-z 0-9 _ - . may be used"));
    }
    Ok(())
}

impl Job {
    /// Detects the launcher from the environment and joins the job.
    ///
    /// See the [module documentation](self) for the launchers and their
    /// variables. A launcher whose variables are present but which cannot
    /// be joined is an error, never a single-rank job.
    pub fn from_environment() -> Result<Job, LaunchError> {
        Self::from_variables(&ProcessEnvironment)
    }

    /// [`Job::from_environment`] with variables from `vars`.
    pub(crate) fn from_variables(vars: &dyn Variables) -> Result<Job, LaunchError> {
        let limit = timeout(vars)?;
        if vars.var("PMI_FD").is_some() || vars.var("PMI_PORT").is_some() {
            let (client, rank, size) = pmi1::Client::join(vars, limit)?;
            let local = local_pair(vars, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")?;
            return Ok(Job {
                rank,
                size,
                local,
                launcher: Launcher::Hydra,
                space: Some(Space::Pmi1(client)),
            });
        }
        for variable in ["PMI_RANK", "PMI_SIZE", "PMI_ID"] {
            if vars.var(variable).is_some() {
                return Err(LaunchError::Variable {
                    variable: variable.into(),
                    reason: "set, but neither PMI_FD nor PMI_PORT is: a PMI-1 launcher \
                             started this process without a connection to its process manager"
                        .into(),
                });
            }
        }
        let ompi = ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]
            .iter()
            .any(|v| vars.var(v).is_some());
        if ompi {
            let rank = required_number(vars, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")?;
            let size = required_number(vars, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")?;
            check_rank(rank, size, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")?;
            let client = pmix::Client::join(vars, Launcher::OpenMpi)?;
            if (client.rank(), client.size()) != (rank, size) {
                return Err(LaunchError::Variable {
                    variable: "OMPI_COMM_WORLD_RANK".into(),
                    reason: format!(
                        "rank {rank} of {size}, but the PMIx server says rank {} of {}",
                        client.rank(),
                        client.size()
                    ),
                });
            }
            let local = local_pair(
                vars,
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            )?
            .or(client.local());
            return Ok(Job {
                rank,
                size,
                local,
                launcher: Launcher::OpenMpi,
                space: Some(Space::Pmix(client)),
            });
        }
        if vars.var("PMIX_NAMESPACE").is_some() || vars.var("PMIX_RANK").is_some() {
            let client = pmix::Client::join(vars, Launcher::Pmix)?;
            return Ok(Job {
                rank: client.rank(),
                size: client.size(),
                local: client.local(),
                launcher: Launcher::Pmix,
                space: Some(Space::Pmix(client)),
            });
        }
        if let Some((space, rank, size)) = env::DirectorySpace::join(vars, limit)? {
            let local = local_pair(vars, "PINDOWN_LOCAL_RANK", "PINDOWN_LOCAL_SIZE")?
                .or(Some((rank, size)));
            return Ok(Job {
                rank,
                size,
                local,
                launcher: Launcher::Environment,
                space: Some(Space::Directory(space)),
            });
        }
        Ok(Job::single())
    }

    /// A job of one rank with a local key-value space.
    pub fn single() -> Job {
        Job {
            rank: 0,
            size: 1,
            local: Some((0, 1)),
            launcher: Launcher::Single,
            space: Some(Space::Local(HashMap::new())),
        }
    }

    /// This process's rank, 0 to [`Job::size`] - 1.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The launcher that started the job.
    pub fn launcher(&self) -> Launcher {
        self.launcher
    }

    /// This rank's number among the ranks of its host, if the launcher
    /// says (Hydra's `MPI_LOCALRANKID`, Open MPI, PMIx,
    /// `PINDOWN_LOCAL_RANK`; the environment launcher without it takes all
    /// ranks to be on one host; not known under Slurm's PMI-1).
    pub fn local_rank(&self) -> Option<u32> {
        self.local.map(|(rank, _)| rank)
    }

    /// The number of ranks on this host, if the launcher says.
    pub fn local_size(&self) -> Option<u32> {
        self.local.map(|(_, size)| size)
    }

    fn space(&mut self) -> Result<&mut Space, LaunchError> {
        self.space.as_mut().ok_or(LaunchError::Finalized)
    }

    /// Publishes `value` under `key` for this rank; other ranks see it
    /// after the next [`Job::fence`].
    pub fn put(&mut self, key: &str, value: &[u8]) -> Result<(), LaunchError> {
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(LaunchError::ValueTooLarge {
                key: key.into(),
                len: value.len(),
            });
        }
        let rank = self.rank;
        match self.space()? {
            Space::Pmi1(client) => client.put(rank, key, value),
            Space::Pmix(client) => client.put(key, value),
            Space::Directory(space) => space.put(key, value),
            Space::Local(map) => {
                map.insert(key.into(), value.to_vec());
                Ok(())
            }
        }
    }

    /// Commits this rank's puts and waits for every rank to do the same
    /// (collective): afterwards every rank's published values are visible.
    pub fn fence(&mut self) -> Result<(), LaunchError> {
        match self.space()? {
            Space::Pmi1(client) => client.barrier(),
            Space::Pmix(client) => client.fence(true),
            Space::Directory(space) => space.fence(),
            Space::Local(_) => Ok(()),
        }
    }

    /// Waits for every rank (collective), publishing nothing.
    pub fn barrier(&mut self) -> Result<(), LaunchError> {
        match self.space()? {
            Space::Pmi1(client) => client.barrier(),
            Space::Pmix(client) => client.fence(false),
            Space::Directory(space) => space.fence(),
            Space::Local(_) => Ok(()),
        }
    }

    /// The value `rank` published under `key` before the last fence.
    pub fn get(&mut self, rank: u32, key: &str) -> Result<Vec<u8>, LaunchError> {
        check_key(key)?;
        let size = self.size;
        if rank >= size {
            return Err(LaunchError::RankOutOfRange { rank, size });
        }
        match self.space()? {
            Space::Pmi1(client) => client.get(rank, key),
            Space::Pmix(client) => client.get(rank, key),
            Space::Directory(space) => space.get(rank, key),
            Space::Local(map) => map.get(key).cloned().ok_or_else(|| LaunchError::NotFound {
                rank,
                key: key.into(),
                detail: String::new(),
            }),
        }
    }

    /// Every rank's `value` under `key`, in rank order (collective: put,
    /// fence, and a get per other rank).
    pub fn all_gather(&mut self, key: &str, value: &[u8]) -> Result<Vec<Vec<u8>>, LaunchError> {
        self.put(key, value)?;
        self.fence()?;
        (0..self.size)
            .map(|rank| {
                if rank == self.rank {
                    Ok(value.to_vec())
                } else {
                    self.get(rank, key)
                }
            })
            .collect()
    }

    /// Leaves the job: tells the launcher this rank is done.
    pub fn finalize(mut self) -> Result<(), LaunchError> {
        self.leave()
    }

    fn leave(&mut self) -> Result<(), LaunchError> {
        match self.space.take() {
            None => Ok(()),
            Some(Space::Pmi1(client)) => client.finalize(),
            Some(Space::Pmix(client)) => client.finalize(),
            Some(Space::Directory(_) | Space::Local(_)) => Ok(()),
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Err(error) = self.leave() {
            tracing::warn!("leaving the job: {error}");
        }
    }
}

/// Lower-case hexadecimal of `bytes`.
pub(crate) fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        text.push(DIGITS[usize::from(b >> 4)] as char);
        text.push(DIGITS[usize::from(b & 15)] as char);
    }
    text
}

/// The bytes of hexadecimal `text` (either case).
pub(crate) fn hex_decode(text: &str) -> Result<Vec<u8>, String> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let text = text.as_bytes();
    if !text.len().is_multiple_of(2) {
        return Err(format!("odd number of hexadecimal digits ({})", text.len()));
    }
    text.chunks_exact(2)
        .map(|pair| match (digit(pair[0]), digit(pair[1])) {
            (Some(high), Some(low)) => Ok(high << 4 | low),
            _ => Err(format!(
                "{:?} is not hexadecimal",
                String::from_utf8_lossy(pair)
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests;
