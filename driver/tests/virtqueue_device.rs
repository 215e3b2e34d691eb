//! The driver-side split virtqueue against rust-vmm's device-side
//! `virtio_queue::Queue`, over a second mapping of the arena's memfd (as the
//! device process maps it), with guest addresses equal to the driver's
//! virtual addresses (identity IOVAs).

use std::collections::VecDeque;
use std::sync::Arc;

use pindown_driver::{ChainElement, DmaArena, DmaBuffer, QueueError, SplitQueue};
use proptest::prelude::*;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};

/// The device's view: its own mapping of the arena, and its queue.
struct Device {
    mem: GuestMemoryMmap,
    queue: Queue,
}

impl Device {
    fn new(arena: &Arc<DmaArena>, driver: &SplitQueue<u64>) -> Self {
        let file = std::fs::File::from(arena.fd().try_clone_to_owned().unwrap());
        let mem = GuestMemoryMmap::from_ranges_with_files([(
            GuestAddress(arena.addr()),
            arena.size(),
            Some(FileOffset::new(file, 0)),
        )])
        .unwrap();
        let layout = driver.layout();
        let mut queue = Queue::new(layout.size).unwrap();
        queue.set_size(layout.size);
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        let (lo, hi) = split(layout.desc_addr);
        queue.set_desc_table_address(lo, hi);
        let (lo, hi) = split(layout.avail_addr);
        queue.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(layout.used_addr);
        queue.set_used_ring_address(lo, hi);
        queue.set_event_idx(driver.event_idx());
        queue.set_ready(true);
        assert!(queue.is_valid(&mem), "device rejects the driver's layout");
        Self { mem, queue }
    }

    /// Pops one chain: (head, descriptors).
    fn pop(&mut self) -> Option<(u16, Vec<Descriptor>)> {
        let chain = self.queue.pop_descriptor_chain(&self.mem)?;
        let head = chain.head_index();
        Some((head, chain.collect()))
    }

    /// Reads a readable descriptor's bytes through the device mapping.
    fn read(&self, desc: &Descriptor) -> Vec<u8> {
        let mut out = vec![0u8; desc.len() as usize];
        self.mem.read_slice(&mut out, desc.addr()).unwrap();
        out
    }

    fn write(&self, desc: &Descriptor, data: &[u8]) {
        self.mem.write_slice(data, desc.addr()).unwrap();
    }

    fn complete(&mut self, head: u16, len: u32) {
        self.queue.add_used(&self.mem, head, len).unwrap();
    }
}

fn setup(size: u16) -> (Arc<DmaArena>, SplitQueue<u64>, Device) {
    let arena = DmaArena::new(4 << 20).unwrap();
    let queue = SplitQueue::new(&arena, size, true).unwrap();
    let device = Device::new(&arena, &queue);
    (arena, queue, device)
}

fn buffer(arena: &Arc<DmaArena>, bytes: &[u8]) -> DmaBuffer {
    let b = arena.alloc(bytes.len().max(1), 64).unwrap();
    b.write_at(0, bytes);
    b
}

#[test]
fn chains_reach_the_device_and_completions_come_back() {
    let (arena, mut queue, mut device) = setup(16);
    let request = buffer(&arena, b"request header..");
    let payload = buffer(&arena, b"the payload bytes");
    let reply = arena.alloc(64, 64).unwrap();
    reply.fill(0);
    let head = queue
        .add(
            &[
                ChainElement::readable(request.iova(), request.len() as u32),
                ChainElement::readable(payload.iova(), payload.len() as u32),
                ChainElement::writable(reply.iova(), reply.len() as u32),
            ],
            42,
        )
        .unwrap();
    assert_eq!(queue.num_free(), 13);
    assert!(queue.kick_needed(), "first publication needs a kick");

    let (dev_head, descs) = device.pop().expect("device sees the chain");
    assert_eq!(dev_head, head);
    assert_eq!(descs.len(), 3);
    assert!(!descs[0].is_write_only() && !descs[1].is_write_only());
    assert!(descs[2].is_write_only());
    assert_eq!(device.read(&descs[0]), b"request header..");
    assert_eq!(device.read(&descs[1]), b"the payload bytes");
    assert_eq!(descs[2].addr().0, reply.iova());
    device.write(&descs[2], b"done: 17 bytes");
    device.complete(dev_head, 14);

    let (token, len) = queue.pop_used().unwrap().expect("completion");
    assert_eq!((token, len), (42, 14));
    let mut seen = [0u8; 14];
    reply.read_at(0, &mut seen);
    assert_eq!(&seen, b"done: 17 bytes");
    assert_eq!(queue.num_free(), 16);
    assert!(queue.pop_used().unwrap().is_none());
}

#[test]
fn event_idx_batches_doorbells_and_skips_them_for_a_busy_device() {
    let (arena, mut queue, mut device) = setup(8);
    let b = arena.alloc(64, 64).unwrap();
    let el = [ChainElement::readable(b.iova(), 64)];

    // A burst of three adds costs one doorbell.
    for token in 0..3 {
        queue.add(&el, token).unwrap();
    }
    assert!(queue.kick_needed());
    assert!(!queue.kick_needed(), "nothing new since the last kick");

    // The device drains the ring and re-arms (avail_event = 3).
    let mut heads = Vec::new();
    while let Some((head, _)) = device.pop() {
        heads.push(head);
    }
    assert_eq!(heads.len(), 3);
    assert!(!device.queue.enable_notification(&device.mem).unwrap());
    queue.add(&el, 3).unwrap();
    assert!(queue.kick_needed(), "an idle, re-armed device needs a kick");

    // The device is now busy (has not re-armed): further adds need no kick.
    queue.add(&el, 4).unwrap();
    assert!(
        !queue.kick_needed(),
        "a busy device polls without a doorbell"
    );
    queue.add(&el, 5).unwrap();
    queue.add(&el, 6).unwrap();
    assert!(!queue.kick_needed());

    // The device re-arms with work pending: enable_notification says so.
    assert!(device.queue.enable_notification(&device.mem).unwrap());
    while let Some((head, _)) = device.pop() {
        heads.push(head);
    }
    assert_eq!(heads.len(), 7);
    assert!(!device.queue.enable_notification(&device.mem).unwrap());
    queue.add(&el, 7).unwrap();
    assert!(queue.kick_needed());
}

#[test]
fn used_event_drives_device_notifications() {
    let (arena, mut queue, mut device) = setup(8);
    let b = arena.alloc(64, 64).unwrap();
    let el = [ChainElement::writable(b.iova(), 64)];
    for token in 0..6 {
        queue.add(&el, token).unwrap();
    }
    let mut chains = Vec::new();
    while let Some((head, _)) = device.pop() {
        chains.push(head);
    }
    assert_eq!(chains.len(), 6);

    // Interrupts enabled, nothing pending yet.
    assert!(!queue.enable_interrupts());
    device.complete(chains[0], 1);
    assert!(
        device.queue.needs_notification(&device.mem).unwrap(),
        "first completion after enabling notifies"
    );
    device.complete(chains[1], 2);
    assert!(
        !device.queue.needs_notification(&device.mem).unwrap(),
        "one notification until the driver catches up"
    );
    assert_eq!(queue.pop_used().unwrap(), Some((0, 1)));
    assert_eq!(queue.pop_used().unwrap(), Some((1, 2)));
    assert_eq!(queue.pop_used().unwrap(), None);
    device.complete(chains[2], 3);
    assert!(
        device.queue.needs_notification(&device.mem).unwrap(),
        "popping re-arms while interrupts are enabled"
    );

    // Disabled: completions do not notify.
    queue.disable_interrupts();
    assert_eq!(queue.pop_used().unwrap(), Some((2, 3)));
    device.complete(chains[3], 4);
    assert!(!device.queue.needs_notification(&device.mem).unwrap());
    device.complete(chains[4], 5);
    assert!(!device.queue.needs_notification(&device.mem).unwrap());

    // Re-enabling with completions pending reports them (no lost wake-up).
    assert!(
        queue.enable_interrupts(),
        "pending completions must be reported"
    );
    assert_eq!(queue.pop_used().unwrap(), Some((3, 4)));
    assert_eq!(queue.pop_used().unwrap(), Some((4, 5)));
    assert!(!queue.enable_interrupts());
    device.complete(chains[5], 6);
    assert!(device.queue.needs_notification(&device.mem).unwrap());
    assert_eq!(queue.pop_used().unwrap(), Some((5, 6)));
    assert_eq!(queue.num_free(), 8);
}

#[test]
fn ring_indices_wrap_around() {
    let (arena, mut queue, mut device) = setup(4);
    let b = arena.alloc(64, 64).unwrap();
    for round in 0u64..70_000 {
        let head = queue
            .add(&[ChainElement::writable(b.iova(), 64)], round)
            .unwrap();
        let (dev_head, _) = device.pop().unwrap();
        assert_eq!(head, dev_head);
        device.complete(dev_head, (round % 64) as u32);
        assert_eq!(
            queue.pop_used().unwrap(),
            Some((round, (round % 64) as u32))
        );
    }
    assert_eq!(queue.num_free(), 4);
}

#[test]
fn a_device_writing_garbage_breaks_the_queue_without_panicking() {
    let (arena, mut queue, mut device) = setup(8);
    let b = arena.alloc(64, 64).unwrap();
    queue
        .add(&[ChainElement::writable(b.iova(), 16)], 1)
        .unwrap();
    let (head, _) = device.pop().unwrap();
    // Claims more bytes than the chain can hold.
    device.complete(head, 4096);
    let err = queue.pop_used().unwrap_err();
    assert!(
        matches!(err, QueueError::BadUsedLength { len: 4096, .. }),
        "{err}"
    );
    assert!(matches!(
        queue.add(&[ChainElement::readable(b.iova(), 1)], 2),
        Err(QueueError::Broken(_))
    ));

    // A head that is not in flight.
    let (arena, mut queue, mut device) = setup(8);
    let b2 = arena.alloc(64, 64).unwrap();
    queue
        .add(&[ChainElement::writable(b2.iova(), 16)], 1)
        .unwrap();
    device.pop().unwrap();
    device.complete(5, 0);
    assert_eq!(queue.pop_used().unwrap_err(), QueueError::BadUsedId(5));
}

#[derive(Debug, Clone)]
enum Op {
    /// Add a chain of `readable` + `writable` buffers.
    Add { readable: u8, writable: u8 },
    /// The device pops up to `n` chains into its pending set.
    DevicePop(u8),
    /// The device completes its pending chain at position `pick % pending`.
    DeviceComplete(u8),
    /// The driver reaps everything completed.
    Reap,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u8..3)
            .prop_filter("non-empty", |(r, w)| r + w > 0)
            .prop_map(|(readable, writable)| Op::Add { readable, writable }),
        2 => (1u8..5).prop_map(Op::DevicePop),
        3 => any::<u8>().prop_map(Op::DeviceComplete),
        1 => Just(Op::Reap),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random add/complete sequences: the device sees each chain with the
    /// driver's buffers, completions come back in the device's order with
    /// their tokens and lengths, and no descriptor leaks.
    #[test]
    fn random_sequences_keep_tokens_order_and_descriptors(ops in prop::collection::vec(op(), 1..200)) {
        let (arena, mut queue, mut device) = setup(16);
        let data = arena.alloc(16 * 64, 64).unwrap();
        let mut next_token = 0u64;
        // Driver's model: token -> (head, buffers).
        let mut posted: std::collections::HashMap<u64, (u16, Vec<ChainElement>)> = Default::default();
        let mut head_token: std::collections::HashMap<u16, u64> = Default::default();
        let mut device_pending: Vec<(u16, Vec<Descriptor>)> = Vec::new();
        let mut expected: VecDeque<(u64, u32)> = VecDeque::new();
        let check_reap = |queue: &mut SplitQueue<u64>, expected: &mut VecDeque<(u64, u32)>| -> Result<(), TestCaseError> {
            while let Some(done) = queue.pop_used().unwrap() {
                prop_assert_eq!(Some(done), expected.pop_front());
            }
            prop_assert!(expected.is_empty());
            Ok(())
        };
        for op in ops {
            match op {
                Op::Add { readable, writable } => {
                    let mut chain = Vec::new();
                    for i in 0..readable + writable {
                        let slot = (next_token as usize * 3 + i as usize) % 16;
                        chain.push(ChainElement {
                            addr: data.iova() + 64 * slot as u64,
                            len: 8 + i as u32,
                            device_writable: i >= readable,
                        });
                    }
                    let free = queue.num_free();
                    match queue.add(&chain, next_token) {
                        Ok(head) => {
                            prop_assert_eq!(queue.num_free(), free - chain.len() as u16);
                            prop_assert!(head_token.insert(head, next_token).is_none(), "head reused while in flight");
                            posted.insert(next_token, (head, chain));
                        }
                        Err(QueueError::Full { needed, free: f }) => {
                            prop_assert_eq!(needed, chain.len());
                            prop_assert!(f < needed as u16);
                        }
                        Err(other) => prop_assert!(false, "unexpected error {}", other),
                    }
                    next_token += 1;
                }
                Op::DevicePop(n) => {
                    for _ in 0..n {
                        let Some((head, descs)) = device.pop() else { break };
                        let token = head_token[&head];
                        let (_, chain) = &posted[&token];
                        prop_assert_eq!(descs.len(), chain.len());
                        for (d, el) in descs.iter().zip(chain) {
                            prop_assert_eq!(d.addr().0, el.addr);
                            prop_assert_eq!(d.len(), el.len);
                            prop_assert_eq!(d.is_write_only(), el.device_writable);
                        }
                        device_pending.push((head, descs));
                    }
                }
                Op::DeviceComplete(pick) => {
                    if device_pending.is_empty() { continue; }
                    let (head, descs) = device_pending.remove(pick as usize % device_pending.len());
                    let writable: u32 = descs.iter().filter(|d| d.is_write_only()).map(|d| d.len()).sum();
                    let len = if writable == 0 { 0 } else { pick as u32 % (writable + 1) };
                    device.complete(head, len);
                    let token = head_token.remove(&head).unwrap();
                    posted.remove(&token);
                    expected.push_back((token, len));
                }
                Op::Reap => check_reap(&mut queue, &mut expected)?,
            }
        }
        // Drain: the device takes and completes everything.
        while let Some((head, descs)) = device.pop() {
            device_pending.push((head, descs));
        }
        for (head, _) in device_pending.drain(..) {
            device.complete(head, 0);
            let token = head_token.remove(&head).unwrap();
            expected.push_back((token, 0));
        }
        check_reap(&mut queue, &mut expected)?;
        prop_assert_eq!(queue.num_free(), 16, "descriptors leaked");
        prop_assert_eq!(queue.in_flight(), 0);
    }
}
