//! The engine against plain memory: ports backed by buffers of this process.

use std::sync::Arc;

use uapi::{
    Access, AtomicWidth, Completion, DeviceInfo, ErrorDetail, Operation, RemoteAddress, RemoteKey,
    Status, WorkRequest, WrFlags, ABI_VERSION, RDMA_FEATURES,
};

use super::{execute, Fabric, Fault, MemoryAccess, Outcome, Span, Spans, Target, WindowTable};

/// A port's memory: one buffer, registered in pieces (IOTLB-like entries
/// of `piece` bytes, each its own span), IOVA = offset + `base`.
struct BufferMemory {
    buffer: Box<[u64]>,
    base: u64,
    piece: usize,
    /// Registered IOVA ranges with write permission or not.
    registered: Vec<(u64, u64, bool)>,
}

// SAFETY (test double): the buffer is only accessed through raw pointers by
// the engine and through atomics/volatile reads by the tests.
unsafe impl Sync for BufferMemory {}
// SAFETY: as above.
unsafe impl Send for BufferMemory {}

impl BufferMemory {
    fn new(bytes: usize, base: u64, piece: usize) -> Self {
        BufferMemory {
            buffer: vec![0u64; bytes / 8].into_boxed_slice(),
            base,
            piece,
            registered: vec![(base, bytes as u64, true)],
        }
    }

    fn byte_ptr(&self) -> *mut u8 {
        self.buffer.as_ptr() as *mut u8
    }

    fn len(&self) -> usize {
        self.buffer.len() * 8
    }

    fn read(&self, iova: u64, len: usize) -> Vec<u8> {
        let offset = (iova - self.base) as usize;
        // SAFETY: in bounds of the buffer; read through a raw pointer.
        (0..len)
            .map(|i| unsafe { self.byte_ptr().add(offset + i).read_volatile() })
            .collect()
    }

    fn write(&self, iova: u64, bytes: &[u8]) {
        let offset = (iova - self.base) as usize;
        for (i, byte) in bytes.iter().enumerate() {
            // SAFETY: in bounds of the buffer; written through a raw pointer.
            unsafe { self.byte_ptr().add(offset + i).write_volatile(*byte) };
        }
    }
}

impl MemoryAccess for BufferMemory {
    fn spans(&self, iova: u64, len: u64, write: bool, out: &mut Spans) -> Result<(), Fault> {
        let end = iova.checked_add(len).ok_or(Fault::Unmapped)?;
        let covered = self
            .registered
            .iter()
            .find(|(start, size, _)| *start <= iova && end <= start + size)
            .ok_or(Fault::Unmapped)?;
        if write && !covered.2 {
            return Err(Fault::Permission("write"));
        }
        let mut at = iova;
        while at < end {
            let offset = (at - self.base) as usize;
            let piece_end = ((offset / self.piece + 1) * self.piece).min(self.len());
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
}

struct Port {
    memory: BufferMemory,
    windows: WindowTable,
    up: bool,
}

struct Device {
    ports: Vec<Port>,
}

impl Device {
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
        })
    }
}

impl Fabric for Device {
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
}

impl Device {
    fn new(ports: usize) -> Self {
        Device {
            ports: (0..ports)
                .map(|i| Port {
                    memory: BufferMemory::new(64 * 1024, 0x10_0000 * (i as u64 + 1), 4096),
                    windows: WindowTable::new(),
                    up: true,
                })
                .collect(),
        }
    }

    fn run(&self, port: u16, op: Operation) -> Completion {
        let info = DeviceInfo {
            port,
            abi_version: ABI_VERSION,
            features: RDMA_FEATURES,
        };
        let request = WorkRequest {
            user_data: 0xfeed,
            flags: WrFlags::SIGNALED,
            op,
        };
        execute(info, &request, self)
    }

    fn bind(&self, port: u16, start: u64, len: u64, access: Access) -> RemoteKey {
        let completion = self.run(port, Operation::BindWindow { start, len, access });
        assert!(completion.is_success(), "{completion:?}");
        RemoteKey(completion.value as u32)
    }

    fn base(&self, port: u16) -> u64 {
        self.ports[port as usize].memory.base
    }
}

fn remote(port: u16, key: RemoteKey, offset: u64) -> RemoteAddress {
    RemoteAddress { port, key, offset }
}

#[test]
fn writes_and_reads_move_exact_bytes_across_spans_at_odd_offsets() {
    let device = Device::new(2);
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let key = device.bind(1, device.base(1) + 100, 20_000, all);
    let pattern: Vec<u8> = (0..9_999u32).map(|i| (i * 7 + 3) as u8).collect();
    device.ports[0]
        .memory
        .write(device.base(0) + 4095, &pattern);
    let written = device.run(
        0,
        Operation::Write {
            local: device.base(0) + 4095,
            len: pattern.len() as u32,
            remote: remote(1, key, 3),
        },
    );
    assert_eq!(
        (written.status, written.byte_len, written.user_data),
        (Status::Success, 9_999, 0xfeed)
    );
    assert_eq!(
        device.ports[1]
            .memory
            .read(device.base(1) + 103, pattern.len()),
        pattern
    );
    // Untouched around it.
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 102, 1),
        vec![0]
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 103 + 9_999, 1),
        vec![0]
    );

    let read = device.run(
        0,
        Operation::Read {
            local: device.base(0) + 30_001,
            len: 7,
            remote: remote(1, key, 3 + 5),
        },
    );
    assert!(read.is_success());
    assert_eq!(
        device.ports[0].memory.read(device.base(0) + 30_001, 7),
        pattern[5..12].to_vec()
    );
}

#[test]
fn bad_keys_bounds_rights_and_registrations_fail_and_touch_nothing() {
    let device = Device::new(3);
    let read_only = device.bind(1, device.base(1), 4096, Access::REMOTE_READ);
    let writable = device.bind(1, device.base(1) + 4096, 4096, Access::REMOTE_WRITE);
    device.ports[0].memory.write(device.base(0), &[0xAB; 64]);
    let before = device.ports[1].memory.read(device.base(1), 16_384);
    let write = |key, offset, len, local| {
        device.run(
            0,
            Operation::Write {
                local,
                len,
                remote: remote(1, key, offset),
            },
        )
    };
    let local = device.base(0);
    let cases = [
        (
            write(read_only, 0, 8, local),
            Status::RemoteAccessError,
            ErrorDetail::Permission,
        ),
        (
            write(RemoteKey(0xdead), 0, 8, local),
            Status::RemoteAccessError,
            ErrorDetail::BadKey,
        ),
        (
            write(writable, 4090, 8, local),
            Status::RemoteAccessError,
            ErrorDetail::OutOfBounds,
        ),
        (
            write(writable, 0, 8, 0x7777_0000),
            Status::LocalProtectionError,
            ErrorDetail::Unregistered,
        ),
    ];
    for (completion, status, detail) in cases {
        assert_eq!(
            (completion.status, completion.detail),
            (status, detail),
            "{completion:?}"
        );
    }
    assert!(device
        .run(1, Operation::RevokeWindow { key: writable })
        .is_success());
    let revoked = write(writable, 0, 8, local);
    assert_eq!(
        (revoked.status, revoked.detail),
        (Status::RemoteAccessError, ErrorDetail::BadKey)
    );
    let unknown = device.run(
        0,
        Operation::Write {
            local,
            len: 8,
            remote: remote(9, writable, 0),
        },
    );
    assert_eq!(unknown.detail, ErrorDetail::UnknownPort);
    assert_eq!(
        device.ports[1].memory.read(device.base(1), 16_384),
        before,
        "target unchanged"
    );
    // Binding memory that is not registered fails.
    let bind = device.run(
        1,
        Operation::BindWindow {
            start: 0x5000_0000,
            len: 8,
            access: Access::REMOTE_READ,
        },
    );
    assert_eq!(bind.status, Status::LocalProtectionError);
}

#[test]
fn a_port_that_is_down_reports_peer_gone() {
    let mut device = Device::new(2);
    let key = device.bind(1, device.base(1), 4096, Access::REMOTE_WRITE);
    device.ports[1].up = false;
    let completion = device.run(
        0,
        Operation::Write {
            local: device.base(0),
            len: 8,
            remote: remote(1, key, 0),
        },
    );
    assert_eq!(
        (completion.status, completion.detail),
        (Status::PeerGone, ErrorDetail::PortDown)
    );
}

#[test]
fn atomics_return_old_values_and_check_alignment() {
    let device = Device::new(2);
    let key = device.bind(1, device.base(1), 4096, Access::REMOTE_ATOMIC);
    let word = remote(1, key, 64);
    let eight = AtomicWidth::Eight;
    let run = |op| device.run(0, op);
    assert_eq!(
        run(Operation::FetchAdd {
            remote: word,
            width: eight,
            add: 5
        })
        .value,
        0
    );
    assert_eq!(
        run(Operation::Swap {
            remote: word,
            width: eight,
            value: 40
        })
        .value,
        5
    );
    let failed = run(Operation::CompareSwap {
        remote: word,
        width: eight,
        compare: 1,
        swap: 2,
    });
    assert_eq!(
        (failed.status, failed.value),
        (Status::Success, 40),
        "a failed compare returns the value"
    );
    assert_eq!(
        run(Operation::CompareSwap {
            remote: word,
            width: eight,
            compare: 40,
            swap: 41
        })
        .value,
        40
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 64, 8),
        41u64.to_le_bytes().to_vec()
    );
    let four = remote(1, key, 128);
    assert_eq!(
        run(Operation::FetchAdd {
            remote: four,
            width: AtomicWidth::Four,
            add: u64::from(u32::MAX)
        })
        .value,
        0
    );
    assert_eq!(
        run(Operation::FetchAdd {
            remote: four,
            width: AtomicWidth::Four,
            add: 2
        })
        .value,
        u64::from(u32::MAX)
    );
    assert_eq!(
        device.ports[1].memory.read(device.base(1) + 128, 8),
        vec![1, 0, 0, 0, 0, 0, 0, 0],
        "wrapped, 4 bytes only"
    );
    let misaligned = run(Operation::FetchAdd {
        remote: remote(1, key, 66),
        width: eight,
        add: 1,
    });
    assert_eq!(
        (misaligned.status, misaligned.detail),
        (Status::InvalidRequest, ErrorDetail::Misaligned)
    );
    let no_right = device.bind(1, device.base(1), 4096, Access::REMOTE_WRITE);
    let denied = run(Operation::FetchAdd {
        remote: remote(1, no_right, 64),
        width: eight,
        add: 1,
    });
    assert_eq!(denied.detail, ErrorDetail::Permission);
}

#[test]
fn concurrent_fetch_adds_from_two_ports_sum_exactly() {
    let device = Arc::new(Device::new(3));
    let key = device.bind(2, device.base(2), 4096, Access::REMOTE_ATOMIC);
    std::thread::scope(|scope| {
        for port in 0..2u16 {
            let device = &device;
            scope.spawn(move || {
                for _ in 0..100_000 {
                    let op = Operation::FetchAdd {
                        remote: remote(2, key, 8),
                        width: AtomicWidth::Eight,
                        add: 1,
                    };
                    assert!(device.run(port, op).is_success());
                }
            });
        }
    });
    assert_eq!(
        device.ports[2].memory.read(device.base(2) + 8, 8),
        200_000u64.to_le_bytes().to_vec()
    );
}
