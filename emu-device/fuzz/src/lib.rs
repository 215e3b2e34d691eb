//! What the fuzz targets and the seed generator share: the input format of
//! the vhost-user targets (a stream of vhost-user messages with the kinds
//! of files sent along) and a fresh port with a small memfd-backed memory
//! table; [`fabric`] holds the fabric target's world.
//!
//! An input is a sequence of messages, each:
//!
//! - 1 byte: the files sent with it: `byte & 7` files, all of kind
//!   `(byte >> 3) % FdKind::COUNT` (see [`FdKind`]);
//! - 12 bytes: the vhost-user header as on the wire (request, flags, size,
//!   little-endian);
//! - `size` bytes of payload (none when `size` is beyond the protocol's
//!   maximum: the header decoder refuses such a header anyway).
//!
//! The sequence ends where the input ends; a message cut short is dropped,
//! as when a frontend disconnects in the middle of one.

pub mod fabric;

use std::cell::RefCell;
use std::fs::File;
use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use arbitrary::Unstructured;
use pindown_emu_device::port::{PortState, PortStats};
use pindown_emu_device::vhost_user::conn::RawMessage;
use pindown_emu_device::vhost_user::handler;
use pindown_emu_device::vhost_user::message::{Header, HEADER_SIZE};
use pindown_emu_device::DeviceConfig;
use vhost::vhost_user::message::{FrontendReq, MAX_MSG_SIZE};

/// Guest physical address of the fresh port's memory.
pub const MEM_GPA: u64 = 0x1000_0000;
/// The frontend's virtual address of that memory.
pub const MEM_UADDR: u64 = 0x7f00_0000;
/// Its size.
pub const MEM_SIZE: u64 = 0x10000;

/// A kind of file a frontend can send with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdKind {
    /// An eventfd (what kick, call and err fds should be).
    EventFd,
    /// A memfd of [`MEM_SIZE`] bytes (what memory tables should carry).
    Memfd,
    /// A memfd of one page.
    SmallMemfd,
    /// An empty memfd.
    EmptyMemfd,
    /// `/dev/null`.
    DevNull,
    /// `/dev/zero` (a non-regular file that maps at any size).
    DevZero,
    /// The read end of a pipe whose writer is closed.
    PipeReader,
    /// The write end of a pipe whose reader is closed.
    PipeWriter,
    /// A unix socket whose peer is closed.
    Socket,
    /// A unix socket whose peer stays open until the next input (what
    /// SET_BACKEND_REQ_FD should carry; see [`start_input`]).
    ConnectedSocket,
}

impl FdKind {
    /// Number of kinds.
    pub const COUNT: u8 = 10;

    /// The kind with number `n % COUNT`.
    pub fn from_number(n: u8) -> FdKind {
        match n % Self::COUNT {
            0 => FdKind::EventFd,
            1 => FdKind::Memfd,
            2 => FdKind::SmallMemfd,
            3 => FdKind::EmptyMemfd,
            4 => FdKind::DevNull,
            5 => FdKind::DevZero,
            6 => FdKind::PipeReader,
            7 => FdKind::PipeWriter,
            8 => FdKind::Socket,
            _ => FdKind::ConnectedSocket,
        }
    }

    /// Its number in the input format.
    pub fn number(self) -> u8 {
        (0..Self::COUNT)
            .find(|n| Self::from_number(*n) == self)
            .unwrap_or(0)
    }

    /// A new file of this kind.
    pub fn make(self) -> File {
        let memfd = |len: u64| {
            let m = memfd::MemfdOptions::default()
                .create("fuzz-mem")
                .expect("memfd");
            m.as_file().set_len(len).expect("memfd size");
            m.into_file()
        };
        match self {
            FdKind::EventFd => {
                // SAFETY: eventfd takes no pointers; the result is checked
                // and then owned by the File alone.
                let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
                assert!(fd >= 0, "eventfd failed");
                // SAFETY: `fd` is a new descriptor nothing else owns.
                unsafe { File::from_raw_fd(fd) }
            }
            FdKind::Memfd => memfd(MEM_SIZE),
            FdKind::SmallMemfd => memfd(4096),
            FdKind::EmptyMemfd => memfd(0),
            FdKind::DevNull => File::options()
                .read(true)
                .write(true)
                .open("/dev/null")
                .expect("/dev/null"),
            FdKind::DevZero => File::options()
                .read(true)
                .write(true)
                .open("/dev/zero")
                .expect("/dev/zero"),
            FdKind::PipeReader | FdKind::PipeWriter => {
                let mut fds = [-1; 2];
                // SAFETY: pipe2 writes two descriptors into `fds`, which has
                // room for them; the result is checked.
                let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
                assert_eq!(rc, 0, "pipe2 failed");
                // SAFETY: both descriptors are new and owned only here.
                let (r, w) =
                    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
                File::from(if self == FdKind::PipeReader { r } else { w })
            }
            FdKind::Socket => {
                let (a, _b) = UnixStream::pair().expect("socketpair");
                File::from(OwnedFd::from(a))
            }
            FdKind::ConnectedSocket => {
                let (a, b) = UnixStream::pair().expect("socketpair");
                PEERS.with(|p| p.borrow_mut().push(b));
                File::from(OwnedFd::from(a))
            }
        }
    }
}

thread_local! {
    /// The open peers of [`FdKind::ConnectedSocket`] files of this input.
    static PEERS: RefCell<Vec<UnixStream>> = const { RefCell::new(Vec::new()) };
}

/// Closes what the previous input left open (the peers of its connected
/// sockets); call at the start of every input.
pub fn start_input() {
    PEERS.with(|p| p.borrow_mut().clear());
}

/// One message as the input carries it.
#[derive(Debug)]
pub struct WireMessage {
    /// The header's bytes.
    pub header: [u8; HEADER_SIZE],
    /// The payload.
    pub payload: Vec<u8>,
    /// The files sent along.
    pub files: Vec<File>,
}

/// Reads the next message; `Err` at the end of the input.
pub fn next_message(u: &mut Unstructured<'_>) -> arbitrary::Result<WireMessage> {
    // `arbitrary` yields zeros past the end of the input; the format ends
    // there instead.
    if u.is_empty() {
        return Err(arbitrary::Error::NotEnoughData);
    }
    let fds: u8 = u.arbitrary()?;
    let mut header = [0u8; HEADER_SIZE];
    header.copy_from_slice(u.bytes(HEADER_SIZE)?);
    let size = u32::from_le_bytes([header[8], header[9], header[10], header[11]]) as usize;
    let payload = if size <= MAX_MSG_SIZE {
        u.bytes(size)?.to_vec()
    } else {
        Vec::new()
    };
    let kind = FdKind::from_number(fds >> 3);
    let files = (0..fds & 7).map(|_| kind.make()).collect();
    Ok(WireMessage {
        header,
        payload,
        files,
    })
}

/// Appends one message in the input format to `out` (for seeds).
pub fn write_message(
    out: &mut Vec<u8>,
    request: FrontendReq,
    need_reply: bool,
    payload: &[u8],
    files: &[FdKind],
) {
    let kind = files.first().map_or(0, |k| k.number());
    assert!(files.len() < 8 && files.iter().all(|k| k.number() == kind));
    out.push(files.len() as u8 | kind << 3);
    let header = Header {
        request: request as u32,
        flags: if need_reply { 0x9 } else { 0x1 },
        size: payload.len() as u32,
    };
    out.write_all(&header.encode()).expect("write to a Vec");
    out.extend_from_slice(payload);
}

/// The payload of a SET_MEM_TABLE with `regions` (gpa, size, uaddr, offset).
pub fn mem_table_payload(regions: &[(u64, u64, u64, u64)]) -> Vec<u8> {
    let mut p = (regions.len() as u32).to_le_bytes().to_vec();
    p.extend_from_slice(&[0; 4]);
    for (gpa, size, uaddr, offset) in regions {
        for v in [gpa, size, uaddr, offset] {
            p.extend_from_slice(&v.to_le_bytes());
        }
    }
    p
}

/// A fresh port (the device's default configuration) whose frontend set a
/// memory table of one [`MEM_SIZE`] memfd region at [`MEM_GPA`] /
/// [`MEM_UADDR`], as the handler's unit tests build it.
pub fn port_with_memory() -> (PortState, PortStats) {
    let cfg = DeviceConfig::default();
    let mut state = PortState::new(0, [2, 0, 0, 0, 0, 1], &cfg, Default::default());
    let stats = PortStats::default();
    let payload = mem_table_payload(&[(MEM_GPA, MEM_SIZE, MEM_UADDR, 0)]);
    let msg = RawMessage {
        header: Header {
            request: FrontendReq::SET_MEM_TABLE as u32,
            flags: 0x9,
            size: payload.len() as u32,
        },
        payload,
        files: vec![FdKind::Memfd.make()],
    };
    let out = handler::handle(&mut state, &stats, msg).expect("a valid memory table");
    assert_eq!(
        out.reply.as_deref().map(|r| &r[HEADER_SIZE..]),
        Some(&0u64.to_le_bytes()[..]),
        "the memory table is accepted"
    );
    (state, stats)
}

/// Sets the process up as the device runs: writes to closed pipes and
/// sockets fail with EPIPE instead of killing it (Rust's runtime does this
/// in the device's `main`), and the open-file limit is raised to its hard
/// limit (an input can send a few thousand files).
pub fn init() {
    // SAFETY: setting a signal's disposition to SIG_IGN involves no handler
    // code and no pointers.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}
