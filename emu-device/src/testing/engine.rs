//! The RDMA engine ([`crate::rdma`]) against plain memory: ports backed
//! by buffers of this process, for the engine's unit tests and the
//! `rdma_engine` fuzz target (feature `test-hooks`).

use std::sync::atomic::{AtomicBool, Ordering};

use pindown_uapi::{
    Access, Completion, DeviceInfo, ErrorDetail, Operation, RemoteAddress, RemoteKey, WorkRequest,
    WrFlags, ABI_VERSION, RDMA_FEATURES,
};

use crate::rdma::{
    execute, AccessFault, Fabric, MemoryAccess, Outcome, Progress, RefusalCounters, Span, Spans,
    Target, Turn, WindowTable,
};

/// A port's memory: one buffer, registered in pieces (IOTLB-like entries
/// of `piece` bytes, each its own span), IOVA = offset + `base`.
pub struct BufferMemory {
    buffer: Box<[u64]>,
    /// The IOVA of the buffer's first byte.
    pub base: u64,
    piece: usize,
    /// Registered IOVA ranges with write permission or not.
    pub registered: Vec<(u64, u64, bool)>,
    /// The owner took the memory away (see [`MemoryAccess::lost`]).
    pub lost: AtomicBool,
}

// SAFETY (test double): the buffer is only accessed through raw pointers by
// the engine and through atomics/volatile reads by the tests.
unsafe impl Sync for BufferMemory {}
// SAFETY: as above.
unsafe impl Send for BufferMemory {}

impl BufferMemory {
    /// `bytes` of zeros at IOVA `base`, mapped in runs of `piece` bytes,
    /// all registered writable.
    pub fn new(bytes: usize, base: u64, piece: usize) -> Self {
        BufferMemory {
            buffer: vec![0u64; bytes / 8].into_boxed_slice(),
            base,
            piece,
            registered: vec![(base, bytes as u64, true)],
            lost: AtomicBool::new(false),
        }
    }

    fn byte_ptr(&self) -> *mut u8 {
        self.buffer.as_ptr() as *mut u8
    }

    /// Bytes of the buffer.
    pub fn size(&self) -> usize {
        self.buffer.len() * 8
    }

    /// The `len` bytes at `iova` (inside the buffer).
    pub fn read(&self, iova: u64, len: usize) -> Vec<u8> {
        let offset = (iova - self.base) as usize;
        // SAFETY: in bounds of the buffer; read through a raw pointer.
        (0..len)
            .map(|i| unsafe { self.byte_ptr().add(offset + i).read_volatile() })
            .collect()
    }

    /// Writes `bytes` at `iova` (inside the buffer).
    pub fn write(&self, iova: u64, bytes: &[u8]) {
        let offset = (iova - self.base) as usize;
        for (i, byte) in bytes.iter().enumerate() {
            // SAFETY: in bounds of the buffer; written through a raw pointer.
            unsafe { self.byte_ptr().add(offset + i).write_volatile(*byte) };
        }
    }
}

impl MemoryAccess for BufferMemory {
    fn spans(&self, iova: u64, len: u64, write: bool, out: &mut Spans) -> Result<(), AccessFault> {
        let end = iova.checked_add(len).ok_or(AccessFault::Unmapped)?;
        let covered = self
            .registered
            .iter()
            .find(|(start, size, _)| *start <= iova && end <= start + size)
            .ok_or(AccessFault::Unmapped)?;
        if write && !covered.2 {
            return Err(AccessFault::Permission("write"));
        }
        let mut at = iova;
        while at < end {
            let offset = (at - self.base) as usize;
            let piece_end = ((offset / self.piece + 1) * self.piece).min(self.size());
            let n = (piece_end - offset).min((end - at) as usize);
            // SAFETY: offset + n stays inside the buffer.
            out.push(Span {
                addr: unsafe { self.byte_ptr().add(offset) },
                len: n,
            });
            at += n as u64;
        }
        Ok(())
    }

    fn lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }
}

/// A port of a [`BufferDevice`].
pub struct BufferPort {
    /// Its memory.
    pub memory: BufferMemory,
    /// Its windows.
    pub windows: WindowTable,
    /// Remote accesses to it refused, by cause.
    pub refused: RefusalCounters,
    /// Whether it is up ([`ErrorDetail::PortDown`] if not).
    pub up: bool,
    /// Its incarnation.
    pub incarnation: std::sync::atomic::AtomicU64,
}

/// Ports of one node of node 0, each over a [`BufferMemory`]: the engine's
/// [`Fabric`] with no process, socket or IOTLB around it.
pub struct BufferDevice {
    /// The ports, by index.
    pub ports: Vec<BufferPort>,
}

impl BufferDevice {
    fn target(&self, port: u16) -> Result<Target<'_>, ErrorDetail> {
        let port = self
            .ports
            .get(port as usize)
            .ok_or(ErrorDetail::UnknownPort)?;
        if !port.up {
            return Err(ErrorDetail::PortDown);
        }
        Ok(Target {
            memory: &port.memory,
            windows: &port.windows,
            refusals: &port.refused,
            incarnation: port.incarnation.load(Ordering::Relaxed),
            node: 0,
        })
    }
}

impl Fabric for BufferDevice {
    fn step(
        &self,
        initiator: u16,
        target: u16,
        step: &mut dyn FnMut(Target<'_>, Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail> {
        let near = self.target(initiator)?;
        Ok(step(near, self.target(target)?))
    }

    fn exclusive(
        &self,
        port: u16,
        change: &mut dyn FnMut(Target<'_>) -> Outcome,
    ) -> Result<Outcome, ErrorDetail> {
        Ok(change(self.target(port)?))
    }

    fn incarnation(&self, port: u16) -> u64 {
        self.ports
            .get(usize::from(port))
            .map_or(0, |port| port.incarnation.load(Ordering::Relaxed))
    }
}

impl BufferDevice {
    /// `ports` ports of 64 KiB each, mapped in 4 KiB runs.
    pub fn new(ports: usize) -> Self {
        Self::with_memory(ports, 64 * 1024)
    }

    /// `ports` ports of `bytes` each, mapped in 4 KiB runs.
    pub fn with_memory(ports: usize, bytes: usize) -> Self {
        BufferDevice {
            ports: (0..ports)
                .map(|i| BufferPort {
                    memory: BufferMemory::new(bytes, 0x1000_0000 * (i as u64 + 1), 4096),
                    windows: WindowTable::new(),
                    refused: RefusalCounters::default(),
                    up: true,
                    incarnation: Default::default(),
                })
                .collect(),
        }
    }

    /// Runs a request to its completion, turn after turn.
    pub fn run(&self, port: u16, op: Operation) -> Completion {
        let mut progress = Progress::default();
        loop {
            if let Turn::Done(done) = self.turn(port, op, &mut progress) {
                return done;
            }
        }
    }

    /// Runs one turn of a request.
    pub fn turn(&self, port: u16, op: Operation, progress: &mut Progress) -> Turn {
        self.turn_with(port, op, &[], progress)
    }

    /// Runs one turn of a request carrying `inline` bytes.
    pub fn turn_with(
        &self,
        port: u16,
        op: Operation,
        inline: &[u8],
        progress: &mut Progress,
    ) -> Turn {
        let info = DeviceInfo {
            port,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
            rdma_queue_pairs: 1,
            node: 0,
        };
        let request = WorkRequest {
            user_data: 0xfeed,
            flags: WrFlags::SIGNALED,
            op,
        };
        execute(info, &request, inline, self, progress)
    }

    /// Runs a WRITE_INLINE of `bytes` to `remote` (it takes one turn).
    pub fn write_inline(&self, port: u16, bytes: &[u8], remote: RemoteAddress) -> Completion {
        let mut head = [0u8; 16];
        let carried = bytes.len().min(16);
        head[..carried].copy_from_slice(&bytes[..carried]);
        let op = Operation::WriteInline {
            len: bytes.len() as u32,
            head,
            remote,
        };
        match self.turn_with(port, op, bytes, &mut Progress::default()) {
            Turn::Done(done) => done,
            Turn::Paused => panic!("an inline write takes one turn"),
        }
    }

    /// Binds a window of `port` open to any port; its key.
    pub fn bind(&self, port: u16, start: u64, len: u64, access: Access) -> RemoteKey {
        self.bind_for(port, start, len, access, None)
    }

    /// Binds a window of `port` for `peer` (any if `None`); its key.
    pub fn bind_for(
        &self,
        port: u16,
        start: u64,
        len: u64,
        access: Access,
        peer: Option<u16>,
    ) -> RemoteKey {
        let completion = self.run(
            port,
            Operation::BindWindow {
                start,
                len,
                access,
                peer: peer.map(|port| pindown_uapi::PortAddress { node: 0, port }),
            },
        );
        assert!(completion.is_success(), "{completion:?}");
        RemoteKey(completion.value)
    }

    /// The IOVA of `port`'s first byte.
    pub fn base(&self, port: u16) -> u64 {
        self.ports[port as usize].memory.base
    }
}

/// The address `offset` bytes into window `key` of port `port` of node 0.
pub fn remote(port: u16, key: RemoteKey, offset: u64) -> RemoteAddress {
    RemoteAddress {
        node: 0,
        port,
        key,
        offset,
    }
}

impl BufferDevice {
    /// Ports of `bytes` each, their memory mapped in runs of `piece` bytes.
    pub fn with_pieces(ports: usize, bytes: usize, piece: usize) -> Self {
        let mut device = Self::with_memory(ports, bytes);
        for (i, port) in device.ports.iter_mut().enumerate() {
            port.memory = BufferMemory::new(bytes, 0x1000_0000 * (i as u64 + 1), piece);
        }
        device
    }

    /// Runs a vector request carrying `descriptor` inline to its end;
    /// returns the completion and the turns it took.
    pub fn run_vector(&self, port: u16, op: Operation, descriptor: &[u8]) -> (Completion, usize) {
        let mut progress = Progress::default();
        for turns in 1.. {
            if let Turn::Done(done) = self.turn_with(port, op, descriptor, &mut progress) {
                return (done, turns);
            }
        }
        unreachable!()
    }
}
