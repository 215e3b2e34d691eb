//! The PMI-1 wire protocol, client side, as MPICH's Hydra and Slurm's
//! `mpi/pmi2` plugin serve it.
//!
//! Each request and each reply is one line of `key=value` words separated
//! by single spaces, the first word being `cmd=...`:
//!
//! ```text
//! cmd=init pmi_version=1 pmi_subversion=1   -> cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0
//! cmd=get_maxes                             -> cmd=maxes kvsname_max=256 keylen_max=64 vallen_max=1024
//! cmd=get_my_kvsname                        -> cmd=my_kvsname kvsname=kvs_1234_0
//! cmd=put kvsname=K key=k value=v           -> cmd=put_result rc=0 msg=success
//! cmd=barrier_in                            -> cmd=barrier_out
//! cmd=get kvsname=K key=k                   -> cmd=get_result rc=0 msg=success value=v
//! cmd=finalize                              -> cmd=finalize_ack
//! ```
//!
//! The connection is the socket `PMI_FD` inherited from the process
//! manager, or a TCP connection to `PMI_PORT` (`host:port`); in the latter
//! case a process with `PMI_ID` first introduces itself with
//! `cmd=initack pmiid=ID` and is told `cmd=set size=N`, `cmd=set rank=N`,
//! `cmd=set debug=N`.
//!
//! Values may hold neither spaces nor `=`, are at most `vallen_max - 1`
//! bytes, and a whole line at most [`LINE_MAX`] bytes (the buffer of
//! MPICH's own client). A value is therefore sent as lower-case
//! hexadecimal in chunks: rank `r`'s key `k` is the PMI key `pd.k.r`,
//! holding `N:` (the number of chunks) and the first chunk, and chunk `i`
//! (from 1) is the PMI key `pd.k.r.i`.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{
    check_rank, hex_decode, hex_encode, number, required_number, text, LaunchError, Variables,
    MAX_VALUE_LEN,
};

/// The longest line MPICH's PMI-1 client sends or accepts
/// (`PMIU_MAXLINE`), newline included.
pub(crate) const LINE_MAX: usize = 1024;

/// The longest reply line this client reads before calling the reply
/// malformed.
const REPLY_MAX: usize = 64 * 1024;

/// The longest wait for `finalize_ack`, which a working process manager
/// sends at once.
const FINALIZE_TIMEOUT: Duration = Duration::from_secs(10);

/// Set once a job took `PMI_FD`: the descriptor is closed with the job,
/// and its number may since name something else.
static PMI_FD_TAKEN: AtomicBool = AtomicBool::new(false);

/// One parsed line: its words as (key, value), the command first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reply {
    pairs: Vec<(String, String)>,
    line: String,
}

impl Reply {
    /// The value of `cmd`.
    pub(crate) fn command(&self) -> &str {
        &self.pairs[0].1
    }

    /// The whole line.
    pub(crate) fn line(&self) -> &str {
        &self.line
    }

    /// The value of the first word `key=...`.
    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses a reply line (without its newline). Words without `=` continue
/// the previous word's value (some servers put spaces in `msg`).
pub(crate) fn parse_reply(line: &str) -> Result<Reply, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for word in line.split(' ').filter(|w| !w.is_empty()) {
        match word.split_once('=') {
            Some((key, value)) if !key.is_empty() => pairs.push((key.into(), value.into())),
            _ => match pairs.last_mut() {
                Some((_, value)) => {
                    value.push(' ');
                    value.push_str(word);
                }
                None => return Err(format!("the first word {word:?} is not key=value")),
            },
        }
    }
    match pairs.first() {
        None => Err("empty line".into()),
        Some((key, _)) if key != "cmd" => Err(format!("starts with {key:?}, not cmd")),
        Some(_) => Ok(Reply {
            pairs,
            line: line.into(),
        }),
    }
}

/// Whether `word` can be a key or value on the wire: printable ASCII
/// without space or `=`, not empty.
pub(crate) fn wire_safe(word: &str) -> bool {
    !word.is_empty() && word.bytes().all(|b| b.is_ascii_graphic() && b != b'=')
}

/// The request line `cmd=COMMAND k=v ...` with its newline.
pub(crate) fn request_line(command: &str, args: &[(&str, &str)]) -> String {
    let mut line = format!("cmd={command}");
    for (key, value) in args {
        line.push(' ');
        line.push_str(key);
        line.push('=');
        line.push_str(value);
    }
    line.push('\n');
    line
}

/// The PMI key of chunk `chunk` of rank `rank`'s `key`.
pub(crate) fn chunk_key(key: &str, rank: u32, chunk: u32) -> String {
    if chunk == 0 {
        format!("pd.{key}.{rank}")
    } else {
        format!("pd.{key}.{rank}.{chunk}")
    }
}

/// The most hexadecimal digits one chunk may hold, given the server's
/// `vallen_max`, the job's kvsname and the longest PMI key of the value.
/// `None` if the limits leave no room.
pub(crate) fn chunk_capacity(
    vallen_max: usize,
    kvsname: &str,
    longest_key: usize,
) -> Option<usize> {
    // "cmd=put kvsname=" K " key=" k " value=" v "\n"
    let overhead = "cmd=put kvsname= key= value=\n".len() + kvsname.len() + longest_key;
    let by_line = LINE_MAX.checked_sub(overhead)?;
    let by_server = vallen_max.checked_sub(1)?;
    // Room for the chunk count "N:" in the first chunk.
    let header = u32::MAX.to_string().len() + 1;
    let room = by_line.min(by_server).checked_sub(header)? & !1;
    (room >= 2).then_some(room)
}

/// Splits `value` into the PMI values of its chunks.
pub(crate) fn encode_chunks(value: &[u8], capacity: usize) -> Vec<String> {
    let hex = hex_encode(value);
    let mut chunks: Vec<String> = hex
        .as_bytes()
        .chunks(capacity)
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect();
    if chunks.is_empty() {
        chunks.push(String::new());
    }
    let count = chunks.len();
    chunks[0] = format!("{count}:{}", chunks[0]);
    chunks
}

/// The chunk count and first chunk's digits of a first chunk's value.
pub(crate) fn decode_header(first: &str) -> Result<(u32, &str), String> {
    let (count, digits) = first
        .split_once(':')
        .ok_or_else(|| "no chunk count".to_string())?;
    let count: u32 = count
        .parse()
        .map_err(|_| format!("chunk count {count:?} is not a number"))?;
    // Every chunk holds at least 2 digits, so a value within the limit
    // needs at most this many.
    if count == 0 || count as usize > MAX_VALUE_LEN {
        return Err(format!("chunk count {count} is out of range"));
    }
    Ok((count, digits))
}

/// A line-oriented connection to the process manager.
struct Connection {
    fd: OwnedFd,
    buffer: Vec<u8>,
    timeout: Duration,
}

impl Connection {
    fn io_error(command: &str, source: io::Error) -> LaunchError {
        LaunchError::Connection {
            command: command.into(),
            source,
        }
    }

    fn send(&mut self, command: &str, line: &str) -> Result<(), LaunchError> {
        let mut rest = line.as_bytes();
        while !rest.is_empty() {
            // SAFETY: `rest` is a live byte slice and the length passed is
            // its length; `fd` is an open socket owned by this connection.
            let sent = unsafe {
                libc::send(
                    self.fd.as_raw_fd(),
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if sent < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Self::io_error(command, error));
            }
            rest = &rest[sent as usize..];
        }
        Ok(())
    }

    /// One reply line, without its newline.
    fn receive(&mut self, command: &str) -> Result<String, LaunchError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buffer.drain(..=end).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return String::from_utf8(line).map_err(|e| LaunchError::Protocol {
                    command: command.into(),
                    reply: String::from_utf8_lossy(e.as_bytes()).into_owned(),
                    reason: "the reply is not UTF-8".into(),
                });
            }
            if self.buffer.len() > REPLY_MAX {
                return Err(LaunchError::Protocol {
                    command: command.into(),
                    reply: String::from_utf8_lossy(&self.buffer[..80]).into_owned() + "...",
                    reason: format!("no end of line within {REPLY_MAX} bytes"),
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Self::io_error(
                    command,
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "no reply from the process manager within {:?} \
                             (PINDOWN_LAUNCH_TIMEOUT)",
                            self.timeout
                        ),
                    ),
                ));
            }
            let mut poll = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let millis = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: `poll` is one valid pollfd, and 1 is the count.
            let ready = unsafe { libc::poll(&mut poll, 1, millis) };
            if ready < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Self::io_error(command, error));
            }
            if ready == 0 {
                continue;
            }
            let mut chunk = [0u8; 4096];
            // SAFETY: `chunk` is writable for its whole length, which is
            // the length passed; `fd` is an open socket owned here.
            let got = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    chunk.as_mut_ptr().cast(),
                    chunk.len(),
                    0,
                )
            };
            if got < 0 {
                let error = io::Error::last_os_error();
                if matches!(
                    error.kind(),
                    io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                ) {
                    continue;
                }
                return Err(Self::io_error(command, error));
            }
            if got == 0 {
                return Err(Self::io_error(
                    command,
                    io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the process manager closed the connection",
                    ),
                ));
            }
            self.buffer.extend_from_slice(&chunk[..got as usize]);
        }
    }

    /// Sends `command` with `args` and reads the reply, which must be
    /// `expect` and, if it has an `rc`, `rc=0`.
    fn call(
        &mut self,
        command: &str,
        args: &[(&str, &str)],
        expect: &str,
    ) -> Result<Reply, LaunchError> {
        let line = request_line(command, args);
        let shown = line.trim_end().to_string();
        self.send(&shown, &line)?;
        let reply = self.receive(&shown)?;
        check_reply(&shown, &reply, expect)
    }
}

/// Parses `reply` to `command` and checks that it is `expect` with `rc=0`
/// (if it has an `rc`).
pub(crate) fn check_reply(command: &str, reply: &str, expect: &str) -> Result<Reply, LaunchError> {
    let protocol = |reason: String| LaunchError::Protocol {
        command: command.into(),
        reply: reply.into(),
        reason,
    };
    let parsed = parse_reply(reply).map_err(|reason| {
        let framed = reply
            .trim_start()
            .trim_start_matches(|c: char| c.is_ascii_digit());
        if framed.len() < reply.len() && framed.starts_with("cmd=") {
            protocol(format!(
                "{reason}: a length-prefixed PMI-2 reply; this process manager speaks \
                 PMI-2 only (Slurm: use srun --mpi=pmi2, whose server also speaks PMI-1)"
            ))
        } else {
            protocol(reason)
        }
    })?;
    if parsed.command() != expect {
        return Err(protocol(format!("expected cmd={expect}")));
    }
    if let Some(rc) = parsed.get("rc") {
        if rc != "0" {
            let message = parsed.get("msg").unwrap_or("no message");
            return Err(protocol(format!("failed with rc={rc}: {message}")));
        }
    }
    Ok(parsed)
}

/// A joined PMI-1 job.
pub(crate) struct Client {
    connection: Connection,
    kvsname: String,
    keylen_max: usize,
    vallen_max: usize,
}

impl Client {
    /// Connects through `PMI_FD` or `PMI_PORT`, runs `init`, and learns the
    /// limits and the kvsname. Returns the client, the rank and the size.
    pub(crate) fn join(
        vars: &dyn Variables,
        timeout: Duration,
    ) -> Result<(Client, u32, u32), LaunchError> {
        let inherited = vars.var("PMI_FD").is_some();
        let fd = if inherited {
            inherited_socket(vars)?
        } else {
            connect(&text(vars, "PMI_PORT")?.unwrap_or_default(), timeout)?
        };
        let mut connection = Connection {
            fd,
            buffer: Vec::new(),
            timeout,
        };
        // Through PMI_PORT, a process with PMI_ID learns its rank and
        // size from the process manager; otherwise they are variables.
        let id = if inherited {
            None
        } else {
            number(vars, "PMI_ID")?
        };
        let (rank, size) = match id {
            Some(id) => initack(&mut connection, id)?,
            None => {
                let because = if inherited { "PMI_FD" } else { "PMI_PORT" };
                (
                    required_number(vars, "PMI_RANK", because)?,
                    required_number(vars, "PMI_SIZE", because)?,
                )
            }
        };
        check_rank(rank, size, "PMI_RANK", "PMI_SIZE")?;
        let client = Client::init(connection)?;
        Ok((client, rank, size))
    }

    /// `init`, `get_maxes` and `get_my_kvsname` on a fresh connection.
    fn init(mut connection: Connection) -> Result<Client, LaunchError> {
        let init = connection
            .call(
                "init",
                &[("pmi_version", "1"), ("pmi_subversion", "1")],
                "response_to_init",
            )
            .map_err(|error| match error {
                LaunchError::Connection { command, source } => LaunchError::Protocol {
                    command,
                    reply: String::new(),
                    reason: format!(
                        "{source} (a process manager that speaks only PMI-2 drops PMI-1's init)"
                    ),
                },
                other => other,
            })?;
        if let Some(version) = init.get("pmi_version") {
            if version != "1" {
                return Err(LaunchError::Protocol {
                    command: "init".into(),
                    reply: init.line().into(),
                    reason: "the process manager does not speak PMI version 1".into(),
                });
            }
        }
        let maxes = connection.call("get_maxes", &[], "maxes")?;
        let limit = |key: &str| -> Result<usize, LaunchError> {
            let value = maxes.get(key).unwrap_or("");
            match value.parse::<usize>() {
                Ok(n) if (2..=1 << 20).contains(&n) => Ok(n),
                _ => Err(LaunchError::Protocol {
                    command: "get_maxes".into(),
                    reply: maxes.line().into(),
                    reason: format!("{key} is missing or not a number from 2 to 2^20"),
                }),
            }
        };
        let kvsname_max = limit("kvsname_max")?;
        let keylen_max = limit("keylen_max")?;
        let vallen_max = limit("vallen_max")?;
        let named = connection.call("get_my_kvsname", &[], "my_kvsname")?;
        let kvsname = named.get("kvsname").unwrap_or("").to_string();
        if !wire_safe(&kvsname) || kvsname.len() >= kvsname_max {
            return Err(LaunchError::Protocol {
                command: "get_my_kvsname".into(),
                reply: named.line().into(),
                reason: format!(
                    "the kvsname is empty, holds spaces or '=', or is not below kvsname_max={kvsname_max}"
                ),
            });
        }
        Ok(Client {
            connection,
            kvsname,
            keylen_max,
            vallen_max,
        })
    }

    /// Publishes `value` as chunks of hexadecimal (see the module docs).
    pub(crate) fn put(&mut self, rank: u32, key: &str, value: &[u8]) -> Result<(), LaunchError> {
        // The longest chunk key is the one with the largest chunk number.
        let longest_possible = chunk_key(key, rank, MAX_VALUE_LEN as u32).len();
        if chunk_key(key, rank, 0).len() >= self.keylen_max {
            return Err(LaunchError::InvalidKey {
                key: key.into(),
                reason: format!(
                    "as PMI key {:?} it is not below the process manager's keylen_max={}",
                    chunk_key(key, rank, 0),
                    self.keylen_max
                ),
            });
        }
        let capacity = chunk_capacity(self.vallen_max, &self.kvsname, longest_possible)
            .ok_or_else(|| LaunchError::Protocol {
                command: "get_maxes".into(),
                reply: format!("vallen_max={}", self.vallen_max),
                reason: format!(
                    "no room for a value in a PMI-1 line with kvsname {:?}",
                    self.kvsname
                ),
            })?;
        let chunks = encode_chunks(value, capacity);
        for (index, chunk) in chunks.iter().enumerate() {
            let pmi_key = chunk_key(key, rank, index as u32);
            if pmi_key.len() >= self.keylen_max {
                return Err(LaunchError::ValueTooLarge {
                    key: key.into(),
                    len: value.len(),
                });
            }
            let kvsname = self.kvsname.clone();
            self.connection.call(
                "put",
                &[("kvsname", &kvsname), ("key", &pmi_key), ("value", chunk)],
                "put_result",
            )?;
        }
        Ok(())
    }

    /// One PMI value, `Err(detail)` if the server has no such key.
    fn get_raw(&mut self, pmi_key: &str) -> Result<Result<String, String>, LaunchError> {
        let kvsname = self.kvsname.clone();
        let line = request_line("get", &[("kvsname", &kvsname), ("key", pmi_key)]);
        let shown = line.trim_end().to_string();
        self.connection.send(&shown, &line)?;
        let reply = self.connection.receive(&shown)?;
        let parsed = parse_reply(&reply).map_err(|reason| LaunchError::Protocol {
            command: shown.clone(),
            reply: reply.clone(),
            reason,
        })?;
        if parsed.command() != "get_result" {
            return Err(LaunchError::Protocol {
                command: shown,
                reply,
                reason: "expected cmd=get_result".into(),
            });
        }
        match parsed.get("rc") {
            Some("0") => Ok(Ok(parsed.get("value").unwrap_or("").to_string())),
            _ => Ok(Err(format!(": the process manager replied {reply:?}"))),
        }
    }

    /// The value rank `rank` published under `key`.
    pub(crate) fn get(&mut self, rank: u32, key: &str) -> Result<Vec<u8>, LaunchError> {
        let malformed = |reason: String| LaunchError::Malformed {
            rank,
            key: key.into(),
            reason,
        };
        let first =
            self.get_raw(&chunk_key(key, rank, 0))?
                .map_err(|detail| LaunchError::NotFound {
                    rank,
                    key: key.into(),
                    detail,
                })?;
        let (count, digits) = decode_header(&first).map_err(malformed)?;
        let mut hex = digits.to_string();
        for chunk in 1..count {
            let part = self
                .get_raw(&chunk_key(key, rank, chunk))?
                .map_err(|detail| {
                    malformed(format!("chunk {chunk} of {count} is missing{detail}"))
                })?;
            hex.push_str(&part);
            if hex.len() > 2 * MAX_VALUE_LEN {
                return Err(malformed(format!("longer than {MAX_VALUE_LEN} bytes")));
            }
        }
        hex_decode(&hex).map_err(malformed)
    }

    /// `barrier_in`, then wait for `barrier_out`.
    pub(crate) fn barrier(&mut self) -> Result<(), LaunchError> {
        self.connection
            .call("barrier_in", &[], "barrier_out")
            .map(drop)
    }

    /// `finalize`, then wait for `finalize_ack` (at most
    /// [`FINALIZE_TIMEOUT`]: a job dropped after a failure must not hang).
    pub(crate) fn finalize(mut self) -> Result<(), LaunchError> {
        self.connection.timeout = self.connection.timeout.min(FINALIZE_TIMEOUT);
        self.connection
            .call("finalize", &[], "finalize_ack")
            .map(drop)
    }
}

/// Takes the socket `PMI_FD` names, after checking that it is one.
fn inherited_socket(vars: &dyn Variables) -> Result<OwnedFd, LaunchError> {
    let value = text(vars, "PMI_FD")?.unwrap_or_default();
    let broken = |reason: String| LaunchError::Variable {
        variable: "PMI_FD".into(),
        reason: format!(
            "{value:?} {reason}: a PMI-1 launcher (Hydra's mpiexec, srun --mpi=pmi2) \
             should have passed its socket there"
        ),
    };
    let fd: i32 = match value.trim().parse() {
        Ok(fd) if fd >= 0 => fd,
        _ => return Err(broken("is not a file descriptor number".into())),
    };
    // SAFETY: fstat writes only into `stat`, a local of the right type;
    // an fd that is not open makes it fail with EBADF, nothing else.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 {
        return Err(broken(format!(
            "is not an open file descriptor ({})",
            io::Error::last_os_error()
        )));
    }
    if stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(broken(format!(
            "is open but not a socket (file mode {:o})",
            stat.st_mode
        )));
    }
    if PMI_FD_TAKEN.swap(true, Ordering::SeqCst) {
        return Err(broken(
            "was already taken by an earlier job of this process (join once)".into(),
        ));
    }
    // SAFETY: `fd` is open (fstat succeeded) and is the process manager's
    // socket, which by the PMI convention belongs to the PMI client; the
    // flag above makes this the only owner in the process.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: F_SETFD on an open descriptor only changes its flags.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(fd)
}

/// Connects to `PMI_PORT`'s `host:port`.
fn connect(port: &str, timeout: Duration) -> Result<OwnedFd, LaunchError> {
    let broken = |reason: String| LaunchError::Variable {
        variable: "PMI_PORT".into(),
        reason: format!("{port:?}: {reason}"),
    };
    let addresses = port
        .to_socket_addrs()
        .map_err(|e| broken(format!("not a reachable host:port ({e})")))?;
    let mut last = None;
    for address in addresses {
        match TcpStream::connect_timeout(&address, timeout) {
            Ok(stream) => {
                stream.set_nodelay(true).ok();
                return Ok(OwnedFd::from(stream));
            }
            Err(error) => last = Some(error),
        }
    }
    Err(broken(match last {
        Some(error) => format!("cannot connect to the process manager: {error}"),
        None => "names no address".into(),
    }))
}

/// The `PMI_PORT` introduction: `initack` with `PMI_ID`, then the
/// process manager's `set size`, `set rank` and `set debug`.
fn initack(connection: &mut Connection, id: u32) -> Result<(u32, u32), LaunchError> {
    let id = id.to_string();
    connection.call("initack", &[("pmiid", &id)], "initack")?;
    let mut set = |name: &str| -> Result<u32, LaunchError> {
        let command = format!("initack pmiid={id}");
        let reply = connection.receive(&command)?;
        let parsed = check_reply(&command, &reply, "set")?;
        parsed
            .get(name)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| LaunchError::Protocol {
                command,
                reply: reply.clone(),
                reason: format!("expected cmd=set {name}=N"),
            })
    };
    let size = set("size")?;
    let rank = set("rank")?;
    set("debug")?;
    Ok((rank, size))
}
