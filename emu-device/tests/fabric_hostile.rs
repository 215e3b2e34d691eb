//! A hostile node of the fabric: the test plays a peer with a plain UDP
//! socket (headers built with the crate's public `net::wire` encoder,
//! messages with `internode::message`) against real device processes, and
//! checks that the device stays alive, idle when idle, bounded in memory,
//! writes nothing outside the windows it was given, counts what it
//! refused, and keeps serving its other peers and ports: hostile lengths,
//! windows, patterns and origins; a peer that acknowledges its answers
//! slowly, claims answers it never sends, floods, restarts, makes up MAC
//! addresses, or asks for long copies inside one node; and a target that
//! holds back its refusal of a vector write's first part (the notifying
//! last part must wait for it), or stays silent while a request is held
//! for its check.

mod common;

use std::collections::BTreeSet;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::{
    buffer_contents as contents, fabric_context_config as config, salted_bytes as fill,
    DeviceProcess,
};
use pindown_driver::verbs::opcode::{AtomicTo, Entry, Read, Vector, Write};
use pindown_driver::verbs::{CompletionQueue, Context};
use pindown_emu_device::internode::message::{FrameDatagram, Message, Origin, PartNotice};
use pindown_emu_device::net::wire::{Header, StreamHeader, HEADER_LEN};
use pindown_uapi::pattern::{Block, BlockList, Dim, Pattern, Piece};
use pindown_uapi::{
    Access, Arrival, AtomicOp, AtomicWidth, Completion, ErrorDetail, PortAddress, RemoteAddress,
    RemoteKey, Status,
};

const TOKEN: &str = "5eed0f1ab";
const FABRIC: u64 = 0x5eed0f1ab;

fn device(node: u16, ports: &[u16], nports: usize, extra: &[&str]) -> DeviceProcess {
    common::fabric_device(node, ports, TOKEN, nports, extra)
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap()
        .parse()
        .unwrap()
}

/// CPU ticks the process used over `over` while nobody talks to it.
fn idle_ticks(pid: u32, over: Duration) -> u64 {
    let before = common::cpu_ticks(pid);
    std::thread::sleep(over);
    common::cpu_ticks(pid) - before
}

/// A hostile node speaking the fabric's datagram format by hand.
struct Raw {
    sock: UdpSocket,
    dev: SocketAddr,
    me: u16,
    dev_node: u16,
    inc: u64,
    dev_inc: u64,
    /// My next request / reply seq.
    next: [u32; 2],
    /// Seqs of mine the device acknowledged, per stream (cumulative).
    acked: [u32; 2],
    acked_sack: [u64; 2],
    /// Seqs of the device's streams received.
    got: [BTreeSet<u32>; 2],
    /// Messages received: (reply stream?, seq, payload).
    inbox: Vec<(bool, u32, Vec<u8>)>,
    /// Outstanding messages of mine: (stream, seq, payload).
    unacked: Vec<(usize, u32, Vec<u8>)>,
    /// Acknowledge the device's replies only below this (None: all).
    reply_ack_cap: Option<u32>,
    /// Send nothing at all (no acks, no retransmissions).
    silent: bool,
    /// Added to every horizon sent.
    horizon_lie: u32,
    last_resend: Instant,
}

impl Raw {
    fn new(me: u16, port: u16, dev_node: u16, dev_port: u16) -> Raw {
        let sock = UdpSocket::bind(("127.0.0.1", port)).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(1)))
            .unwrap();
        Raw {
            sock,
            dev: format!("127.0.0.1:{dev_port}").parse().unwrap(),
            me,
            dev_node,
            inc: 0x1111_2222_3333_4444 ^ u64::from(std::process::id()),
            dev_inc: 0,
            next: [0, 0],
            acked: [0, 0],
            acked_sack: [0, 0],
            got: [BTreeSet::new(), BTreeSet::new()],
            inbox: Vec::new(),
            unacked: Vec::new(),
            reply_ack_cap: None,
            silent: false,
            horizon_lie: 0,
            last_resend: Instant::now(),
        }
    }

    /// Cumulative ack of the device's stream `s`.
    fn cum(&self, s: usize) -> u32 {
        let mut n = 0u32;
        while self.got[s].contains(&n) {
            n += 1;
        }
        n
    }

    fn header(&self, message: Option<(usize, u32)>, len: usize) -> Vec<u8> {
        let mut reply_ack = self.cum(1);
        if let Some(cap) = self.reply_ack_cap {
            reply_ack = reply_ack.min(cap);
        }
        let header = Header {
            fabric: FABRIC,
            source: self.me,
            destination: self.dev_node,
            source_incarnation: self.inc,
            destination_incarnation: self.dev_inc,
            seq: message.map(|(_, seq)| seq),
            reply: message.is_some_and(|(s, _)| s == 1),
            probe: false,
            probe_echo: false,
            horizon: self.next[1].wrapping_add(self.horizon_lie),
            requests: StreamHeader {
                ack: self.cum(0),
                floor: 0,
                sack: 0,
            },
            replies: StreamHeader {
                ack: reply_ack,
                floor: 0,
                sack: 0,
            },
            payload_len: len as u16,
        };
        let mut d = vec![0u8; HEADER_LEN + len];
        header.encode(&mut d);
        d
    }

    fn put(&self, message: Option<(usize, u32)>, payload: &[u8]) {
        let mut d = self.header(message, payload.len());
        d[HEADER_LEN..].copy_from_slice(payload);
        let _ = self.sock.send_to(&d, self.dev);
    }

    fn pure_ack(&self) {
        self.put(None, &[]);
    }

    /// Sends a message of stream `s` (0 request, 1 reply).
    fn send(&mut self, s: usize, payload: &[u8]) -> u32 {
        let seq = self.next[s];
        self.next[s] += 1;
        self.unacked.push((s, seq, payload.to_vec()));
        if !self.silent {
            self.put(Some((s, seq)), payload);
        }
        seq
    }

    fn request(&mut self, payload: &[u8]) -> u32 {
        self.send(0, payload)
    }

    fn is_acked(&self, s: usize, seq: u32) -> bool {
        let ack = self.acked[s];
        seq < ack
            || (seq > ack && seq - ack <= 64 && self.acked_sack[s] & (1 << (seq - ack - 1)) != 0)
    }

    /// Takes what arrived for `wait`, acks it, resends what is unacked.
    fn pump(&mut self, wait: Duration) {
        let deadline = Instant::now() + wait;
        let mut buf = vec![0u8; 65536];
        loop {
            let mut new = false;
            while let Ok((n, from)) = self.sock.recv_from(&mut buf) {
                if from != self.dev {
                    continue;
                }
                let Ok((h, payload)) = Header::decode(&buf[..n]) else {
                    continue;
                };
                if h.source_incarnation != self.dev_inc {
                    self.dev_inc = h.source_incarnation;
                    // A new life of the device: start again.
                    if h.destination_incarnation != self.inc {
                        self.got = [BTreeSet::new(), BTreeSet::new()];
                    }
                }
                if h.destination_incarnation == self.inc {
                    for (s, sh) in [h.requests, h.replies].into_iter().enumerate() {
                        if sh.ack.wrapping_sub(self.acked[s]) < 1 << 31 {
                            self.acked[s] = sh.ack;
                            self.acked_sack[s] = sh.sack;
                        }
                    }
                }
                if let Some(seq) = h.seq {
                    let s = usize::from(h.reply);
                    if h.destination_incarnation == self.inc && self.got[s].insert(seq) {
                        self.inbox.push((h.reply, seq, payload.to_vec()));
                    }
                    new = true;
                }
            }
            let acked: Vec<bool> = self
                .unacked
                .iter()
                .map(|&(s, seq, _)| self.is_acked(s, seq))
                .collect();
            let mut i = 0;
            self.unacked.retain(|_| {
                i += 1;
                !acked[i - 1]
            });
            if !self.silent {
                if new {
                    self.pure_ack();
                }
                if self.last_resend.elapsed() > Duration::from_millis(5) {
                    self.last_resend = Instant::now();
                    for (s, seq, payload) in &self.unacked {
                        self.put(Some((*s, *seq)), payload);
                    }
                }
            }
            if Instant::now() >= deadline {
                return;
            }
        }
    }

    /// Pumps until every message of mine is acknowledged.
    fn settle(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.unacked.is_empty() {
            assert!(Instant::now() < deadline, "device never acknowledged");
            self.pump(Duration::from_millis(2));
        }
    }

    /// RESULT messages received: (tag, status, detail).
    fn results(&self) -> Vec<(u64, Status, ErrorDetail, u64)> {
        self.inbox
            .iter()
            .filter_map(|(_, _, p)| match Message::decode(p) {
                Ok(Message::Result {
                    tag,
                    status,
                    detail,
                    value,
                }) => Some((tag, status, detail, value)),
                _ => None,
            })
            .collect()
    }
}

/// An encoded strided pattern: blocks of `block` bytes from `offset`, in
/// three loops of (count, stride), covering `len` bytes.
fn strided(offset: i64, block: u64, counts: [u64; 3], strides: [i64; 3], len: u64) -> Vec<u8> {
    Pattern {
        repeat: 1,
        extent: 0,
        skip: 0,
        len,
        pieces: vec![Piece::Strided {
            offset,
            block,
            dims: [
                Dim {
                    count: counts[0],
                    stride: strides[0],
                },
                Dim {
                    count: counts[1],
                    stride: strides[1],
                },
                Dim {
                    count: counts[2],
                    stride: strides[2],
                },
            ],
        }],
    }
    .encode()
}

fn origin(node: u16, tag: u64) -> Origin {
    Origin {
        node,
        port: 0,
        incarnation: 0,
        tag,
    }
}

/// A READ of `len` bytes at `offset` of window `key` of port `dst_port`.
fn read_message(origin: Origin, dst_port: u16, key: RemoteKey, offset: u64, len: u32) -> Vec<u8> {
    encode(Message::Read {
        origin,
        dst_port,
        key,
        offset,
        len,
    })
}

/// A WRITE of `bytes` at `offset` of window `key` of port `dst_port`.
fn write_message(
    origin: Origin,
    dst_port: u16,
    key: RemoteKey,
    offset: u64,
    bytes: &[u8],
) -> Vec<u8> {
    encode(Message::Write {
        origin,
        dst_port,
        key,
        offset,
        bytes,
    })
}

/// A VECTOR_WRITE of `bytes` along `pattern` from `offset` of window `key`
/// of port `dst_port`.
fn vector_write_message(
    origin: Origin,
    dst_port: u16,
    key: RemoteKey,
    offset: u64,
    pattern: &[u8],
    bytes: &[u8],
) -> Vec<u8> {
    notifying_write_message(origin, dst_port, key, offset, pattern, bytes, None)
}

/// A VECTOR_WRITE part as [`vector_write_message`], the last of its write
/// when it carries `notice`.
fn notifying_write_message(
    origin: Origin,
    dst_port: u16,
    key: RemoteKey,
    offset: u64,
    pattern: &[u8],
    bytes: &[u8],
    notice: Option<PartNotice>,
) -> Vec<u8> {
    encode(Message::VectorWrite {
        origin,
        dst_port,
        key,
        offset,
        pattern,
        bytes,
        notice,
    })
}

/// An ATOMIC on the word at `offset` of window `key` of port `dst_port`.
fn atomic_message(
    origin: Origin,
    dst_port: u16,
    key: RemoteKey,
    offset: u64,
    width: AtomicWidth,
    op: AtomicOp,
) -> Vec<u8> {
    encode(Message::Atomic {
        origin,
        dst_port,
        key,
        offset,
        width,
        op,
    })
}

fn encode(m: Message<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    m.encode(&mut out);
    out
}

fn run_entry(ctx: &Context, entry: Entry<'_>, timeout: Duration) -> Option<Completion> {
    let mut cq: CompletionQueue<'_> = ctx.create_completion_queue();
    let mut qp = ctx.create_queue_pair(&mut cq).unwrap();
    qp.post(&[entry.signaled()]).unwrap();
    match cq.wait(timeout) {
        Ok(done) => done.into_iter().next(),
        Err(_) => None,
    }
}

const WIN_AT: u64 = 16384;
const WIN_LEN: u64 = 4096;

/// Many hostile messages from a peer that completed the handshake: every
/// one refused or carried out inside the window, counted; nothing outside
/// the window changes; the device stays idle, small, and serves.
#[test]
fn hostile_messages_from_a_joined_peer() {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let mut dev = device(0, &ports, 2, &["--peer-timeout", "2s"]);
    let ctx = Context::open(dev.socket(0), config()).unwrap();
    let other = Context::open(dev.socket(1), config()).unwrap();
    let buf = ctx.alloc(1 << 16, 4096).unwrap();
    let before = fill(1 << 16, 7);
    buf.write_at(0, &before);
    let region = ctx.register_buffer(&buf).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let window = ctx.bind_window(&region, WIN_AT, WIN_LEN, all).unwrap();
    let w = window.remote();
    // A window only port 1 of node 0 itself may use.
    let bound = ctx
        .bind_window_for_peer(&region, 32768, 4096, all, PortAddress { node: 0, port: 1 })
        .unwrap();
    let b = bound.remote();
    let pid = dev.pid();
    let rss0 = rss_kib(pid);

    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    // Handshake: a read of 0 bytes.
    let o = |tag| origin(1, tag);
    me.request(&read_message(o(1), 0, w.key, 0, 0));
    me.settle();
    me.pump(Duration::from_millis(50));
    assert!(me.dev_inc != 0);
    println!("handshake done: results {:?}", me.results());
    let status0 = dev.fabric_status();

    let key = w.key;
    let bytes_100 = [0xAAu8; 100];
    let mut attacks: Vec<(&str, Vec<u8>)> = vec![
        ("empty message", vec![]),
        ("unknown kind", vec![0x77; 60]),
        ("write header cut", vec![1u8; 47]),
        ("key 0", {
            let mut m = write_message(o(10), 0, key, 0, &bytes_100);
            m[24..32].fill(0);
            m
        }),
        (
            "write straddling the end",
            write_message(o(11), 0, key, WIN_LEN - 50, &bytes_100),
        ),
        (
            "write offset wraps",
            write_message(o(12), 0, key, u64::MAX - 10, &bytes_100),
        ),
        (
            "write wrong key",
            write_message(o(13), 0, RemoteKey(key.0 ^ 1), 0, &bytes_100),
        ),
        (
            "write port 9 (none)",
            write_message(o(14), 9, key, 0, &bytes_100),
        ),
        (
            "write port 1 (not the window's)",
            write_message(o(15), 1, key, 0, &bytes_100),
        ),
        ("read 4 GiB", read_message(o(20), 0, key, 0, u32::MAX)),
        (
            "read offset wraps",
            read_message(o(21), 0, key, u64::MAX, 2),
        ),
        (
            "read with another node as origin",
            read_message(origin(0, 22), 0, key, 0, 8),
        ),
        (
            "atomic misaligned",
            atomic_message(
                o(30),
                0,
                key,
                3,
                AtomicWidth::Eight,
                AtomicOp::FetchAdd { add: 1 },
            ),
        ),
        (
            "atomic past the end",
            atomic_message(
                o(31),
                0,
                key,
                WIN_LEN - 4,
                AtomicWidth::Eight,
                AtomicOp::Swap { value: 1 },
            ),
        ),
        ("atomic bad width", {
            let mut m = atomic_message(
                o(32),
                0,
                key,
                0,
                AtomicWidth::Eight,
                AtomicOp::Swap { value: 1 },
            );
            m[6] = 3;
            m
        }),
        ("atomic bad op", {
            let mut m = atomic_message(
                o(33),
                0,
                key,
                0,
                AtomicWidth::Eight,
                AtomicOp::Swap { value: 1 },
            );
            m[1] = 99;
            m
        }),
        ("vector write: pattern length past the message", {
            let mut m = vector_write_message(o(40), 0, key, 0, &[0u8; 40], &[]);
            m[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
            m
        }),
        ("vector write: counts 2^64 (overflow)", {
            let p = strided(0, 1, [u64::MAX, u64::MAX, 2], [1, 1, 1], 8);
            vector_write_message(o(41), 0, key, 0, &p, &[1u8; 8])
        }),
        ("vector write: 2^60 one-byte blocks, 8 covered", {
            let p = strided(0, 1, [1 << 20, 1 << 20, 1 << 20], [0, 0, 0], 8);
            vector_write_message(o(42), 0, key, 0, &p, &[2u8; 8])
        }),
        ("vector write: block before the window", {
            let p = strided(-8, 4, [2, 1, 1], [8, 0, 0], 8);
            vector_write_message(o(43), 0, key, 0, &p, &[3u8; 8])
        }),
        ("vector write: block far past the window", {
            let p = strided(0, 4, [2, 1, 1], [1 << 40, 0, 0], 8);
            vector_write_message(o(44), 0, key, 0, &p, &[4u8; 8])
        }),
        ("vector write: stride wraps i64", {
            let p = strided(i64::MAX - 4, 4, [2, 1, 1], [i64::MAX, 0, 0], 8);
            vector_write_message(o(45), 0, key, 0, &p, &[5u8; 8])
        }),
        ("vector write: len disagrees with bytes", {
            let p = strided(0, 4, [4, 1, 1], [8, 0, 0], 16);
            vector_write_message(o(46), 0, key, 0, &p, &[6u8; 9])
        }),
        ("vector write: blocks in memory", {
            let p = Pattern::listed_in_memory(0x1000, 1 << 40, 0).encode();
            vector_write_message(o(47), 0, key, 0, &p, &[])
        }),
        (
            "vector write: repeat 2^64-1 of zero-byte and 1-byte pieces",
            {
                let p = Pattern {
                    repeat: u64::MAX,
                    extent: 0,
                    skip: 0,
                    len: 500,
                    pieces: vec![
                        Piece::Strided {
                            offset: 0,
                            block: 0,
                            dims: [
                                Dim {
                                    count: u64::MAX,
                                    stride: 1,
                                },
                                Dim::ONE,
                                Dim::ONE,
                            ],
                        },
                        Piece::Indexed {
                            offset: 0,
                            blocks: BlockList::Listed(
                                std::iter::repeat_n(Block { offset: 0, len: 0 }, 40)
                                    .chain([Block { offset: 1, len: 1 }])
                                    .collect(),
                            ),
                        },
                    ],
                }
                .encode();
                vector_write_message(o(48), 0, key, 0, &p, &[7u8; 500])
            },
        ),
        ("vector write notice: fewer bytes than its part", {
            let p = strided(0, 8, [1, 1, 1], [0, 0, 0], 8);
            let notice = Some(PartNotice {
                immediate: 0xbad1,
                total: 7,
            });
            notifying_write_message(o(53), 0, key, 0, &p, &[8u8; 8], notice)
        }),
        ("vector write notice: a window bound to port 1", {
            let p = strided(0, 8, [1, 1, 1], [0, 0, 0], 8);
            let notice = Some(PartNotice {
                immediate: 0xbad2,
                total: 8,
            });
            notifying_write_message(o(54), 0, b.key, 0, &p, &[9u8; 8], notice)
        }),
        ("vector write notice: past the window", {
            let p = strided(0, 8, [2, 1, 1], [1 << 40, 0, 0], 16);
            let notice = Some(PartNotice {
                immediate: 0xbad3,
                total: 1 << 20,
            });
            notifying_write_message(o(55), 0, key, 0, &p, &[10u8; 16], notice)
        }),
        (
            "check of 4 GiB at the window's end",
            encode(Message::Check {
                origin: o(57),
                dst_port: 0,
                key,
                offset: WIN_LEN,
                len: u32::MAX,
            }),
        ),
        (
            "check through a window bound to port 1",
            encode(Message::Check {
                origin: o(58),
                dst_port: 0,
                key: b.key,
                offset: 0,
                len: 8,
            }),
        ),
        ("vector read: more than a datagram", {
            let p = strided(0, 4096, [1, 1, 1], [0, 0, 0], 4096);
            encode(Message::VectorRead {
                origin: o(50),
                dst_port: 0,
                key,
                offset: 0,
                at: 0,
                pattern: &p,
            })
        }),
        ("vector read: past the window", {
            let p = strided(4000, 200, [1, 1, 1], [0, 0, 0], 200);
            encode(Message::VectorRead {
                origin: o(51),
                dst_port: 0,
                key,
                offset: 0,
                at: u32::MAX,
                pattern: &p,
            })
        }),
        ("vector read: trailing bytes after pattern", {
            let mut p = strided(0, 8, [1, 1, 1], [0, 0, 0], 8);
            p.push(0);
            encode(Message::VectorRead {
                origin: o(52),
                dst_port: 0,
                key,
                offset: 0,
                at: 0,
                pattern: &p,
            })
        }),
        (
            "copy to unknown node",
            encode(Message::Copy {
                origin: o(60),
                dst_port: 0,
                key,
                offset: 0,
                destination: RemoteAddress {
                    node: 4000,
                    port: 0,
                    key,
                    offset: 0,
                },
                len: 64,
            }),
        ),
        (
            "copy 4 GiB within the window",
            encode(Message::Copy {
                origin: o(61),
                dst_port: 0,
                key,
                offset: 0,
                destination: RemoteAddress {
                    node: 0,
                    port: 0,
                    key,
                    offset: 0,
                },
                len: u32::MAX,
            }),
        ),
        (
            "copy from the window to outside it (bound window)",
            encode(Message::Copy {
                origin: o(62),
                dst_port: 0,
                key,
                offset: 0,
                destination: RemoteAddress {
                    node: 0,
                    port: 0,
                    key: b.key,
                    offset: 0,
                },
                len: 64,
            }),
        ),
        (
            "atomic-to an unknown node",
            encode(Message::AtomicTo {
                origin: o(70),
                dst_port: 0,
                key,
                offset: 8,
                width: AtomicWidth::Eight,
                op: AtomicOp::FetchAdd { add: 1 },
                destination: RemoteAddress {
                    node: 4000,
                    port: 0,
                    key,
                    offset: 0,
                },
            }),
        ),
        (
            "read data for no read",
            encode(Message::ReadData {
                tag: 1,
                at: 0,
                bytes: &[1, 2, 3],
            }),
        ),
        (
            "result for no op",
            encode(Message::Result {
                tag: 12345,
                status: Status::Success,
                detail: ErrorDetail::None,
                value: 0,
            }),
        ),
    ];
    // Random bytes after valid kinds.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..300 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let len = (seed % 1376) as usize;
        let mut bytes: Vec<u8> = (0..len)
            .map(|i| (seed.rotate_left(i as u32 % 64) >> 3) as u8)
            .collect();
        if let Some(first) = bytes.first_mut() {
            *first = 1 + (round % 11) as u8;
        }
        if bytes.len() > 32 {
            // Keep the key valid half the time, so checks past decode run.
            if round % 2 == 0 {
                bytes[24..32].copy_from_slice(&key.0.to_le_bytes());
                bytes[4..6].copy_from_slice(&0u16.to_le_bytes());
            }
            if bytes.len() > 42 {
                bytes[40..42].copy_from_slice(&1u16.to_le_bytes());
            }
        }
        attacks.push(("random", bytes));
    }
    let t0 = Instant::now();
    for (_, payload) in &attacks {
        if payload.len() > 1376 {
            continue;
        }
        me.request(payload);
        me.settle();
    }
    me.pump(Duration::from_millis(300));
    println!(
        "{} attacks in {:?}; {} results",
        attacks.len(),
        t0.elapsed(),
        me.results().len()
    );
    for (tag, status, detail, value) in me.results() {
        if tag < 100 {
            println!("  result tag {tag}: {status:?} {detail:?} {value}");
        }
    }
    // Replies that name nothing of the device's.
    for tag in 0..50u64 {
        me.send(
            1,
            &encode(Message::Result {
                tag,
                status: Status::RemoteAccessError,
                detail: ErrorDetail::NotGranted,
                value: 0,
            }),
        );
        me.send(
            1,
            &encode(Message::ReadData {
                tag,
                at: u32::MAX - 1,
                bytes: &[9; 64],
            }),
        );
    }
    me.settle();
    // Frames of odd sizes (from the peer's address).
    for len in [0usize, 1, 5, 11, 12, 13, 14, 15, 60, 1514, 4000, 4080, 5000] {
        let mut d = Vec::new();
        let frame = vec![0xffu8; len];
        FrameDatagram {
            fabric: FABRIC,
            source: 1,
            destination: 0,
            frame: &frame,
        }
        .encode(&mut d);
        let _ = me.sock.send_to(&d, me.dev);
    }
    me.pump(Duration::from_millis(300));

    let status = dev.fabric_status();
    println!("fabric before: {status0:?}");
    println!("fabric after:  {status:?}");
    println!("port 0: {:?}", dev.port(0));
    assert!(dev.alive(), "device died:\n{}", dev.log());
    // No refused part queued an arrival; an honest notifying part from
    // this node's port lands and names it.
    assert_eq!(ctx.arrivals().unwrap(), vec![]);
    let p = strided(0, 8, [2, 1, 1], [64, 0, 0], 16);
    let notice = Some(PartNotice {
        immediate: 0x600d,
        total: 16,
    });
    me.request(&notifying_write_message(
        o(56),
        0,
        key,
        256,
        &p,
        &[0x3c; 16],
        notice,
    ));
    me.settle();
    let arrivals = ctx.wait_arrivals(Duration::from_secs(5)).unwrap();
    assert_eq!(
        arrivals,
        vec![Arrival {
            peer: PortAddress { node: 1, port: 0 },
            key,
            bytes: 16,
            immediate: 0x600d,
        }]
    );
    let landed = contents(&buf);
    let at = (WIN_AT + 256) as usize;
    assert_eq!(&landed[at..at + 8], &[0x3c; 8]);
    assert_eq!(&landed[at + 64..at + 72], &[0x3c; 8]);
    // The six frames shorter than an Ethernet header were dropped and
    // counted, not delivered.
    assert_eq!(
        status.n("frames_dropped") - status0.n("frames_dropped"),
        6,
        "{status:?}"
    );
    let after = contents(&buf);
    let outside_changed: Vec<usize> = (0..after.len())
        .filter(|&i| {
            !(WIN_AT as usize..(WIN_AT + WIN_LEN) as usize).contains(&i) && after[i] != before[i]
        })
        .collect();
    println!(
        "bytes changed outside the window: {} (first {:?})",
        outside_changed.len(),
        outside_changed.first()
    );
    let bound_changed = (32768..32768 + 4096)
        .filter(|&i| after[i] != before[i])
        .count();
    println!("bytes changed in the window bound to port 1: {bound_changed}");
    let idle = idle_ticks(pid, Duration::from_secs(1));
    let rss1 = rss_kib(pid);
    println!("idle ticks over 1 s: {idle}; rss {rss0} KiB -> {rss1} KiB");
    // A local write through port 1 still completes.
    let near = other.alloc(4096, 64).unwrap();
    near.write_at(0, &[0x5a; 4096]);
    let near_region = other.register_buffer(&near).unwrap();
    let done = run_entry(
        &other,
        Write::new(near_region.local(0, 64).unwrap(), w.at(128)).build(),
        Duration::from_secs(10),
    );
    println!("local write via port 1: {done:?}");
    assert!(done.is_some_and(|d| d.is_success()));
    assert!(
        outside_changed.is_empty(),
        "memory outside the window changed"
    );
    assert!(idle < 20, "device spins while idle: {idle} ticks/s");
    drop(bound);
}

/// A peer forging the origin of a WRITE, VECTOR_WRITE or VECTOR_READ
/// (naming a port of the target's own node, as the part of a copy that
/// port delegated would) does not get into a window bound to that port.
#[test]
fn a_forged_origin_writes_into_a_window_bound_to_another_port() {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let mut dev = device(0, &ports, 2, &["--peer-timeout", "2s"]);
    let ctx = Context::open(dev.socket(0), config()).unwrap();
    let _other = Context::open(dev.socket(1), config()).unwrap();
    let buf = ctx.alloc(1 << 16, 4096).unwrap();
    buf.write_at(0, &[0u8; 1 << 16]);
    let region = ctx.register_buffer(&buf).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    // Only port 1 of node 0 may use it.
    let bound = ctx
        .bind_window_for_peer(&region, 0, 4096, all, PortAddress { node: 0, port: 1 })
        .unwrap();
    let b = bound.remote();
    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    // As myself: refused.
    me.request(&write_message(origin(1, 1), 0, b.key, 0, &[0x11; 16]));
    me.settle();
    me.pump(Duration::from_millis(100));
    println!("as node 1: {:?}", me.results());
    // As port 1 of node 0, incarnations 0..64.
    for inc in 0..64u64 {
        me.request(&write_message(
            Origin {
                node: 0,
                port: 1,
                incarnation: inc,
                tag: 100 + inc,
            },
            0,
            b.key,
            64,
            &[0x22; 16],
        ));
        me.settle();
    }
    let mut first = [0u8; 16];
    buf.read_at(0, &mut first);
    // The same as a vector write, and a vector read of the window's first
    // bytes (set now: a read that got through would bring them back).
    buf.write_at(0, &[0x5a; 64]);
    let contiguous = strided(0, 16, [1, 1, 1], [0, 0, 0], 16);
    // Control: the same vector write under node 1's own origin, into a
    // window open to every peer, lands.
    let open = ctx.bind_window(&region, 8192, 4096, all).unwrap();
    me.request(&vector_write_message(
        origin(1, 199),
        0,
        open.remote().key,
        0,
        &contiguous,
        &[0x44; 16],
    ));
    me.settle();
    me.pump(Duration::from_millis(100));
    let mut control = [0u8; 16];
    buf.read_at(8192, &mut control);
    assert_eq!(
        control, [0x44; 16],
        "the well-formed vector write did not land"
    );
    for inc in 0..64u64 {
        let forged = Origin {
            node: 0,
            port: 1,
            incarnation: inc,
            tag: 200 + inc,
        };
        me.request(&vector_write_message(
            forged,
            0,
            b.key,
            128,
            &contiguous,
            &[0x33; 16],
        ));
        me.request(&encode(Message::VectorRead {
            origin: Origin {
                tag: 300 + inc,
                ..forged
            },
            dst_port: 0,
            key: b.key,
            offset: 0,
            at: 0,
            pattern: &contiguous,
        }));
        me.settle();
    }
    me.pump(Duration::from_millis(200));
    let read_back = me.inbox.iter().any(|(_, _, payload)| {
        matches!(Message::decode(payload), Ok(Message::ReadData { bytes, .. }) if bytes.contains(&0x5a))
    });
    assert!(
        !read_back,
        "a vector read posing as port 1 of node 0 read its window"
    );
    let mut vector_landed = [0u8; 16];
    buf.read_at(128, &mut vector_landed);
    assert_eq!(vector_landed, [0u8; 16], "a forged vector write landed");
    let refused: Vec<u64> = me.results().iter().map(|r| r.0).collect();
    let mut landed = [0u8; 16];
    buf.read_at(64, &mut landed);

    println!(
        "refused tags: {refused:?}\nbytes at 0: {first:02x?}\nbytes at 64: {landed:02x?}\nport 0: {:?}",
        dev.port(0)
    );
    assert!(dev.alive());
    assert_eq!(first, [0u8; 16], "write as node 1 landed");
    assert_eq!(
        landed, [0u8; 16],
        "a write from node 1 posing as port 1 of node 0 landed in a window bound to port 1"
    );
}

/// A WRITE of a local port to the hostile node: the peer answers with an
/// error RESULT and acknowledges the part with a horizon it never reaches.
/// The write must complete (with an error) within the operation timeout.
#[test]
fn a_peer_cannot_hold_a_local_write_forever() {
    hold_write(1000, 30);
}

/// Control: the same with an honest horizon completes at once.
#[test]
fn control_an_honest_horizon_completes_the_write() {
    hold_write(0, 8);
}

fn hold_write(horizon_lie: u32, seconds: u64) {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let mut dev = device(0, &ports, 1, &["--peer-timeout", "500ms"]);
    let ctx = Context::open(dev.socket(0), config()).unwrap();
    let near = ctx.alloc(4096, 64).unwrap();
    let near_region = ctx.register_buffer(&near).unwrap();
    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    me.horizon_lie = horizon_lie;
    let remote = RemoteAddress {
        node: 1,
        port: 0,
        key: RemoteKey(0x1234),
        offset: 0,
    };
    let mut cq: CompletionQueue<'_> = ctx.create_completion_queue();
    let mut qp = ctx.create_queue_pair(&mut cq).unwrap();
    qp.post(&[Write::new(near_region.local(0, 8).unwrap(), remote)
        .build()
        .signaled()])
        .unwrap();
    let started = Instant::now();
    let mut answered = false;
    let mut done = None;
    while started.elapsed() < Duration::from_secs(seconds) {
        me.pump(Duration::from_millis(5));
        if started.elapsed() > Duration::from_secs(5)
            && started.elapsed() < Duration::from_millis(5020)
        {
            println!(
                "device CPU ticks over 1 s while the write is held: {}",
                idle_ticks(dev.pid(), Duration::from_secs(1))
            );
        }
        if !answered {
            let tag = me
                .inbox
                .iter()
                .find_map(|(_, _, p)| match Message::decode(p) {
                    Ok(Message::Write { origin, .. }) => Some(origin.tag),
                    _ => None,
                });
            if let Some(tag) = tag {
                answered = true;
                me.send(
                    1,
                    &encode(Message::Result {
                        tag,
                        status: Status::RemoteAccessError,
                        detail: ErrorDetail::NotGranted,
                        value: 0,
                    }),
                );
            }
        }
        if let Ok(c) = cq.poll() {
            if let Some(c) = c.into_iter().next() {
                done = Some((c, started.elapsed()));
                break;
            }
        }
    }
    let status = dev.fabric_status();
    println!("answered: {answered}; completion: {done:?}; fabric: {status:?}");
    assert!(dev.alive());
    let Some((completion, _)) = done else {
        panic!(
            "the write never completed (op timeout is 1 s); started={} completed={} failed={}",
            status.n("started"),
            status.n("completed"),
            status.n("failed")
        );
    };
    // The lie held the write until it expired: it completes with the
    // refusal the peer sent. (This raw peer acknowledges the part before
    // it sends its refusal, so under an honest horizon the write may
    // complete first, successfully, and the refusal arrive late.)
    if horizon_lie > 0 {
        assert_eq!(
            (completion.status, completion.detail),
            (Status::RemoteAccessError, ErrorDetail::NotGranted)
        );
    }
}

/// A peer that acknowledges nothing: a local write to it fails within
/// the peer timeout. A read from a peer that restarts mid-answer fails at
/// once and nothing lands after.
#[test]
fn a_silent_peer_and_a_restarting_peer() {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let mut dev = device(0, &ports, 1, &["--peer-timeout", "1s"]);
    let ctx = Context::open(dev.socket(0), config()).unwrap();
    let near = ctx.alloc(1 << 16, 64).unwrap();
    near.write_at(0, &[0xee; 1 << 16]);
    let near_region = ctx.register_buffer(&near).unwrap();
    let remote = RemoteAddress {
        node: 1,
        port: 0,
        key: RemoteKey(0x1234),
        offset: 0,
    };
    // Silent: the socket is bound, nothing is ever answered.
    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    me.silent = true;
    let mut cq: CompletionQueue<'_> = ctx.create_completion_queue();
    let mut qp = ctx.create_queue_pair(&mut cq).unwrap();
    qp.post(&[Write::new(near_region.local(0, 4096).unwrap(), remote)
        .build()
        .signaled()])
        .unwrap();
    let started = Instant::now();
    let mut done = None;
    while started.elapsed() < Duration::from_secs(10) {
        me.pump(Duration::from_millis(5));
        if let Ok(c) = cq.poll() {
            if let Some(c) = c.into_iter().next() {
                done = Some((c.status, c.detail, started.elapsed()));
                break;
            }
        }
    }
    println!("silent peer: {done:?}");
    assert!(done.is_some_and(|d| d.2 < Duration::from_secs(4)));
    let idle = idle_ticks(dev.pid(), Duration::from_secs(1));
    println!("idle ticks after the silent peer: {idle}");

    // Restart mid-read: answer half the read, then appear with a new
    // incarnation, then send late data of the old life.
    me.silent = false;
    me.inbox.clear();
    me.pump(Duration::from_millis(50));
    qp.post(&[Read::new(near_region.local(0, 8192).unwrap(), remote)
        .build()
        .signaled()])
        .unwrap();
    let started = Instant::now();
    let mut tag = None;
    while tag.is_none() && started.elapsed() < Duration::from_secs(5) {
        me.pump(Duration::from_millis(5));
        tag = me
            .inbox
            .iter()
            .find_map(|(_, _, p)| match Message::decode(p) {
                Ok(Message::Read { origin, len, .. }) => Some((origin.tag, len)),
                _ => None,
            });
    }
    let (tag, len) = tag.expect("the read request came");
    println!("read tag {tag} len {len}");
    me.send(
        1,
        &encode(Message::ReadData {
            tag,
            at: 0,
            bytes: &[0x11; 1000],
        }),
    );
    me.settle();
    let old_inc = me.inc;
    me.inc ^= 0xdead_beef;
    me.next = [0, 0];
    me.got = [BTreeSet::new(), BTreeSet::new()];
    me.unacked.clear();
    me.pure_ack();
    let restarted = Instant::now();
    let mut done = None;
    while restarted.elapsed() < Duration::from_secs(6) {
        me.pump(Duration::from_millis(5));
        if let Ok(c) = cq.poll() {
            if let Some(c) = c.into_iter().next() {
                done = Some((c.status, c.detail, restarted.elapsed()));
                break;
            }
        }
    }
    println!("after restart: {done:?}");
    // Late data of the old life.
    let new_inc = me.inc;
    me.inc = old_inc;
    me.next = [0, 1];
    me.send(
        1,
        &encode(Message::ReadData {
            tag,
            at: 1000,
            bytes: &[0x22; 1000],
        }),
    );
    me.pump(Duration::from_millis(200));
    me.inc = new_inc;
    let mut landed = vec![0u8; 2000];
    near.read_at(0, &mut landed);
    println!(
        "landed: first {:02x} at 1000 {:02x}; fabric {:?}",
        landed[0],
        landed[1000],
        dev.fabric_status()
    );
    assert!(dev.alive());
    assert!(done.is_some_and(|d| d.2 < Duration::from_secs(3)));
    assert_eq!(landed[1000], 0xee, "late data of an old life landed");
}

/// Three nodes: A (device, node 0), the hostile node 1, B (device, node
/// 2). Node 1 asks A for a long read and acknowledges A's answers one at a
/// time, just often enough not to be declared gone. B's reads of A must
/// still be served.
#[test]
fn one_slow_peer_does_not_stall_other_peers() {
    slow_peer(false);
}

/// The same, and each acknowledgement of node 1 carries a COPY within
/// A's window (carried out at once; its RESULT finds no room and waits):
/// A's own requests to B must still go.
#[test]
fn one_slow_peer_does_not_stall_the_devices_own_requests() {
    slow_peer(true);
}

fn slow_peer(copy_trick: bool) {
    let ports = [
        common::free_udp_port(),
        common::free_udp_port(),
        common::free_udp_port(),
    ];
    let timeout = ["--peer-timeout", "2s"];
    let mut a = device(0, &ports, 1, &timeout);
    let mut b = device(2, &ports, 1, &timeout);
    let actx = Context::open(a.socket(0), config()).unwrap();
    let bctx = Context::open(b.socket(0), config()).unwrap();
    let abuf = actx.alloc(1 << 20, 4096).unwrap();
    abuf.write_at(0, &fill(1 << 20, 3));
    let aregion = actx.register_buffer(&abuf).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let awindow = actx.bind_window(&aregion, 0, 1 << 20, all).unwrap();
    let awin = awindow.remote();
    let bbuf = bctx.alloc(1 << 16, 4096).unwrap();
    let bregion = bctx.register_buffer(&bbuf).unwrap();
    let bwindow = bctx.bind_window(&bregion, 0, 1 << 16, all).unwrap();
    let bwin = bwindow.remote();
    let alocal = actx.alloc(4096, 64).unwrap();
    let alocal_region = actx.register_buffer(&alocal).unwrap();

    // Baseline: B reads 8 bytes of A; A writes 8 bytes to B.
    let t = Instant::now();
    let done = run_entry(
        &bctx,
        Read::new(bregion.local(0, 8).unwrap(), awin.at(0)).build(),
        Duration::from_secs(10),
    );
    println!(
        "baseline B reads A: {:?} in {:?}",
        done.map(|d| d.status),
        t.elapsed()
    );

    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    // Handshake first, everything acknowledged.
    me.request(&read_message(origin(1, 1), 0, awin.key, 0, 0));
    me.settle();
    me.pump(Duration::from_millis(50));
    let replies_so_far = me.cum(1);
    // From now on the device's answers are acknowledged one at a time.
    me.reply_ack_cap = Some(replies_so_far);
    me.request(&read_message(origin(1, 2), 0, awin.key, 0, 1 << 20));
    me.settle();
    me.pump(Duration::from_millis(100));
    println!(
        "A's answers received: {} (acknowledged below {replies_so_far})",
        me.cum(1)
    );
    // Keep node 1 alive with one more acknowledged answer every 700 ms,
    // for 12 s, while B reads A and A writes B.
    let stop = Instant::now() + Duration::from_secs(12);
    let pumper = std::thread::spawn(move || {
        let mut last = Instant::now();
        while Instant::now() < stop {
            me.pump(Duration::from_millis(10));
            if last.elapsed() > Duration::from_millis(700) {
                last = Instant::now();
                let cap = me.reply_ack_cap.unwrap() + 1;
                me.reply_ack_cap = Some(cap);
                for k in 0..if copy_trick { 8 } else { 0 } {
                    let tag = 1000 + u64::from(cap) * 8 + k;
                    me.request(&encode(Message::Copy {
                        origin: origin(1, tag),
                        dst_port: 0,
                        key: awin.key,
                        offset: 0,
                        destination: awin.at(8192),
                        len: 64,
                    }));
                }
                if !copy_trick {
                    me.pure_ack();
                }
            }
        }
        me
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut bcq: CompletionQueue<'_> = bctx.create_completion_queue();
    let mut bqp = bctx.create_queue_pair(&mut bcq).unwrap();
    let mut acq: CompletionQueue<'_> = actx.create_completion_queue();
    let mut aqp = actx.create_queue_pair(&mut acq).unwrap();
    let t = Instant::now();
    bqp.post(&[Read::new(bregion.local(0, 8).unwrap(), awin.at(0))
        .build()
        .signaled()])
        .unwrap();
    let (mut bdone, mut adone) = (None, None);
    let mut ta = None;
    while t.elapsed() < Duration::from_secs(11) && (bdone.is_none() || adone.is_none()) {
        if ta.is_none() && t.elapsed() > Duration::from_millis(1500) {
            ta = Some(Instant::now());
            aqp.post(&[Write::new(alocal_region.local(0, 8).unwrap(), bwin.at(0))
                .build()
                .signaled()])
                .unwrap();
        }
        if bdone.is_none() {
            if let Some(c) = bcq.poll().unwrap().next() {
                bdone = Some(((c.status, c.detail), t.elapsed()));
            }
        }
        if adone.is_none() {
            if let Some(c) = acq.poll().unwrap().next() {
                adone = Some(((c.status, c.detail), ta.unwrap().elapsed()));
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let me = pumper.join().unwrap();
    println!(
        "node 1 acknowledged A's answers below {:?}",
        me.reply_ack_cap
    );
    let bread = (bdone, adone);
    println!("during the slow peer: B reads A -> {:?}", bread.0);
    println!("during the slow peer: A writes B -> {:?}", bread.1);
    println!("A fabric: {:?}", a.fabric_status());
    assert!(a.alive() && b.alive());
    // Node 1 stayed a live peer of A the whole time (its answers only
    // crawled), so the others were served beside it, not after it.
    let slow = a
        .fabric_peers()
        .into_iter()
        .find(|peer| peer.get("node") == Some(1))
        .expect("node 1 is a peer of A");
    assert_eq!(slow.n("gone_count"), 0, "{slow:?}");
    assert!(
        matches!(bread.1, Some(((Status::Success, _), _))),
        "A's write to B did not go while node 1 was slow"
    );
    assert!(
        matches!(bread.0, Some(((Status::Success, _), _))),
        "B's read of A was not served while node 1 was slow"
    );
}

/// A peer sending frames with ever new source addresses fills its share of
/// the MAC learning table and no more; frames posing as a port's address
/// are dropped.
#[test]
fn frames_with_ever_new_source_addresses() {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let mut dev = device(0, &ports, 1, &[]);
    let _ctx = Context::open(dev.socket(0), config()).unwrap();
    let sock = UdpSocket::bind(("127.0.0.1", ports[1])).unwrap();
    let to: SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().unwrap();
    let pid = dev.pid();
    std::thread::sleep(Duration::from_millis(300));
    let rss0 = rss_kib(pid);
    let before = dev.fabric_status();
    let total: u64 = 20_000;
    let mut frame = vec![0u8; 60];
    frame[0..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    frame[12..14].copy_from_slice(&[0x88, 0xb5]);
    let mut d = Vec::with_capacity(100);
    let t = Instant::now();
    for i in 0..total {
        // Locally administered unicast source, a new one each frame.
        let mac = (0x02u64 << 40) | (i + 0x1000);
        frame[6..12].copy_from_slice(&mac.to_be_bytes()[2..8]);
        d.clear();
        FrameDatagram {
            fabric: FABRIC,
            source: 1,
            destination: 0,
            frame: &frame,
        }
        .encode(&mut d);
        let _ = sock.send_to(&d, to);
        if i % 500 == 499 {
            std::thread::sleep(Duration::from_micros(600));
        }
    }
    let status = settled_frames(&dev);
    let rss1 = rss_kib(pid);
    let idle = idle_ticks(pid, Duration::from_secs(1));
    println!(
        "{total} frames sent in {:?}; frames_received={} frames_dropped={}; rss {rss0} KiB -> {rss1} KiB; idle ticks {idle}",
        t.elapsed(),
        status.n("frames_received"),
        status.n("frames_dropped")
    );
    assert!(dev.alive());
    assert!(
        rss1 < rss0 + 16 * 1024,
        "RSS grew by {} KiB for {} frames",
        rss1 - rss0,
        status.n("frames_received")
    );
    // The node learnt its share of addresses; the rest were refused and
    // counted (a few frames may be lost on the way: UDP).
    let delta = |key: &str| status.n(key) - before.n(key);
    let (learnt, refused) = (delta("macs_learnt"), delta("macs_refused"));
    let received = delta("frames_received");
    let share = pindown_emu_device::switch::MACS_PER_STATION_MAX as u64;
    assert_eq!(learnt + refused, received, "{status:?}");
    assert_eq!(learnt, received.min(share), "{status:?}");
    assert!(
        received > share,
        "too few frames arrived to fill the share: {status:?}"
    );

    // Frames claiming the address the device gives its port 0 are dropped
    // (they would divert the port's traffic), and counted.
    let dropped = status.n("frames_dropped");
    let port_mac = dev.port(0).text("mac").map(str::to_string).unwrap();
    let port_mac: Vec<u8> = port_mac
        .split(':')
        .map(|byte| u8::from_str_radix(byte, 16).unwrap())
        .collect();
    frame[6..12].copy_from_slice(&port_mac);
    for _ in 0..10 {
        d.clear();
        FrameDatagram {
            fabric: FABRIC,
            source: 1,
            destination: 0,
            frame: &frame,
        }
        .encode(&mut d);
        sock.send_to(&d, to).unwrap();
    }
    let status = settled_frames(&dev);
    assert_eq!(status.n("frames_dropped") - dropped, 10, "{status:?}");
}

/// The fabric status once the device has taken every frame that came
/// (its frame counters stop moving), at most 10 s.
fn settled_frames(dev: &DeviceProcess) -> pindown_emu_device::status::PortStatus {
    settled(dev, |s| s.n("frames_received") + s.n("frames_dropped"))
}

/// The device's `fabric` line once `taken` of it (a count of what the
/// device took from its socket) stopped growing over 200 ms, or after 10 s.
fn settled(
    dev: &DeviceProcess,
    taken: impl Fn(&pindown_emu_device::status::PortStatus) -> u64,
) -> pindown_emu_device::status::PortStatus {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = dev.fabric_status();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = dev.fabric_status();
        if taken(&now) == taken(&last) || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// Node `node`'s line of the device's `fabric` answer.
fn peer_line(dev: &DeviceProcess, node: u16) -> pindown_emu_device::status::PortStatus {
    dev.fabric_peers()
        .into_iter()
        .find(|p| p.n("node") == u64::from(node))
        .unwrap_or_else(|| panic!("node {node} is not a peer of the device"))
}

/// Three nodes: node 1 floods A with valid but useless datagrams (pure
/// acknowledgements and duplicates of a delivered request) as fast as it
/// can while B reads and writes A.
#[test]
fn a_flooding_peer_does_not_starve_another_peer() {
    let ports = [
        common::free_udp_port(),
        common::free_udp_port(),
        common::free_udp_port(),
    ];
    let timeout = ["--peer-timeout", "2s"];
    let mut a = device(0, &ports, 1, &timeout);
    let mut b = device(2, &ports, 1, &timeout);
    let actx = Context::open(a.socket(0), config()).unwrap();
    let bctx = Context::open(b.socket(0), config()).unwrap();
    let abuf = actx.alloc(1 << 20, 4096).unwrap();
    let aregion = actx.register_buffer(&abuf).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let awindow = actx.bind_window(&aregion, 0, 1 << 20, all).unwrap();
    let awin = awindow.remote();
    let bbuf = bctx.alloc(1 << 16, 4096).unwrap();
    let bregion = bctx.register_buffer(&bbuf).unwrap();
    // B writes 4 KiB of a new pattern into A and reads it back, 100 times;
    // every read must bring back the bytes of the write before it.
    let ops = |round: u64| {
        let t = Instant::now();
        let mut worst = Duration::ZERO;
        for i in 0..100u64 {
            let pattern = fill(4096, (round * 100 + i) as u8);
            bbuf.write_at(0, &pattern);
            for read in [false, true] {
                let s = Instant::now();
                let entry = if read {
                    Read::new(bregion.local(8192, 4096).unwrap(), awin.at(0)).build()
                } else {
                    Write::new(bregion.local(0, 4096).unwrap(), awin.at(0)).build()
                };
                let done = run_entry(&bctx, entry, Duration::from_secs(10));
                assert!(done.is_some_and(|d| d.is_success()), "op {i}: {done:?}");
                worst = worst.max(s.elapsed());
            }
            let mut back = vec![0; 4096];
            bbuf.read_at(8192, &mut back);
            assert!(
                back == pattern,
                "round {round}, op {i}: B read other bytes than it wrote"
            );
        }
        (t.elapsed(), worst)
    };
    let served = |dev: &DeviceProcess| settled(dev, |s| s.n("served")).n("served");
    let before = served(&a);
    println!("baseline 200 ops: {:?}", ops(1));
    let served_by_ops = served(&a) - before;
    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    me.request(&read_message(origin(1, 1), 0, awin.key, 0, 0));
    me.settle();
    me.pump(Duration::from_millis(50));
    let before_flood = served(&a);
    let peer_before = peer_line(&a, 1);
    // A duplicate of the delivered request, and a pure acknowledgement.
    let payload = read_message(origin(1, 1), 0, awin.key, 0, 0);
    let mut dup = me.header(Some((0, 0)), payload.len());
    dup[HEADER_LEN..].copy_from_slice(&payload);
    let pure = me.header(None, 0);
    let sock = me.sock.try_clone().unwrap();
    let to = me.dev;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flooder = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut dups, mut pures) = (0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if dups == pures {
                    dups += u64::from(sock.send_to(&dup, to).is_ok());
                } else {
                    pures += u64::from(sock.send_to(&pure, to).is_ok());
                }
            }
            (dups, pures)
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let during = ops(2);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (dups, pures) = flooder.join().unwrap();
    println!("during the flood ({dups} duplicates, {pures} acknowledgements) 200 ops: {during:?}");
    // Counted once the device took what was left in its socket.
    let _ = settled(&a, |s| s.n("datagrams_received"));
    let peer_after = peer_line(&a, 1);
    let delta = |field: &str| peer_after.n(field) - peer_before.n(field);
    println!(
        "A fabric: {:?}\nnode 1 seen from A: {peer_after:?}",
        a.fabric_status()
    );
    assert!(a.alive() && b.alive());
    // The same operations were served again, the flood added none: the
    // duplicate request was not carried out a second time.
    assert_eq!(served(&a) - before_flood, served_by_ops);
    // Node 1 sent nothing but the flood meanwhile: the device received at
    // most what was sent (the kernel drops what overflows its socket), and
    // recognised duplicates among them, no more than the duplicates sent.
    let received = delta("datagrams_received");
    assert!(
        received > 0 && received <= dups + pures,
        "{received} of {dups} + {pures}"
    );
    let duplicates = delta("duplicates");
    assert!(
        duplicates > 0 && duplicates <= dups,
        "{duplicates} duplicates of {dups}"
    );
}

/// Node 1 asks A for copies between two places of one large window of
/// A (both windows on A): they once ran to their end inside one pass of
/// A's link. B's read of A meanwhile. A's link does not spin after work
/// (`--spin-us 0`): a copy waiting for the next pass's share must not put
/// it to sleep.
#[test]
fn large_copies_within_one_node_do_not_stop_the_link() {
    const COPIES: u64 = 400;
    let ports = [
        common::free_udp_port(),
        common::free_udp_port(),
        common::free_udp_port(),
    ];
    let timeout = ["--peer-timeout", "2s"];
    // A's operation timeout (twice its peer timeout) is shorter than the
    // copies take in all: the last ones wait for the older ones' shares
    // longer than that, and must not fail as unreachable for it.
    let mut a = device(0, &ports, 1, &["--peer-timeout", "500ms", "--spin-us", "0"]);
    let b = device(2, &ports, 1, &timeout);
    let actx = Context::open(a.socket(0), config()).unwrap();
    let bctx = Context::open(b.socket(0), config()).unwrap();
    let abuf = actx.alloc(32 << 20, 4096).unwrap();
    let aregion = actx.register_buffer(&abuf).unwrap();
    let all = Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let awindow = actx.bind_window(&aregion, 0, 32 << 20, all).unwrap();
    let awin = awindow.remote();
    let bbuf = bctx.alloc(1 << 16, 4096).unwrap();
    let bregion = bctx.register_buffer(&bbuf).unwrap();
    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    me.request(&read_message(origin(1, 1), 0, awin.key, 0, 0));
    me.settle();
    let pid = a.pid();
    let cpu0 = common::cpu_ticks(pid);
    let t = Instant::now();
    for k in 0..COPIES {
        me.request(&encode(Message::Copy {
            origin: origin(1, 100 + k),
            dst_port: 0,
            key: awin.key,
            offset: 0,
            destination: awin.at(16 << 20),
            len: 16 << 20,
        }));
    }
    let reader = std::thread::spawn(move || {
        me.settle();
        // About two seconds here; a link that slept between the shares of
        // a copy took a second per MiB.
        let deadline = Instant::now() + Duration::from_secs(30);
        while me.results().len() < COPIES as usize + 1 && Instant::now() < deadline {
            me.pump(Duration::from_millis(5));
        }
        me
    });
    std::thread::sleep(Duration::from_millis(20));
    let s = Instant::now();
    let done = run_entry(
        &bctx,
        Read::new(bregion.local(0, 8).unwrap(), awin.at(0)).build(),
        Duration::from_secs(30),
    );
    let bread = s.elapsed();
    let me = reader.join().unwrap();
    println!(
        "{} copies of 16 MiB asked in {} datagrams: {} results in {:?}; A used {} CPU ticks; B's 8-byte read of A meanwhile: {:?} after {bread:?}",
        COPIES, COPIES,
        me.results().len() - 1,
        t.elapsed(),
        common::cpu_ticks(pid) - cpu0,
        done.map(|d| (d.status, d.detail))
    );
    assert!(a.alive());
    // B was served meanwhile (before, A's link stopped for seconds and B
    // declared it gone), and every copy was answered.
    assert!(
        done.is_some_and(|d| d.is_success()),
        "B's read of A: {done:?} after {bread:?}"
    );
    // Every copy was answered: done, or refused as busy while the node's
    // delegated copies were as many as it takes.
    let copies: Vec<_> = me.results().into_iter().skip(1).collect();
    assert_eq!(copies.len(), COPIES as usize);
    let succeeded = copies.iter().filter(|r| r.1 == Status::Success).count();
    assert!(succeeded > 0, "no copy done: {copies:?}");
    assert!(
        copies
            .iter()
            .all(|r| r.1 == Status::Success || r.2 == ErrorDetail::NodeBusy),
        "{copies:?}"
    );
}

/// The notice of a vector write to another node rides on its last part,
/// sent only once every earlier part is acknowledged *and* every answer
/// the target sent before those acknowledgements has arrived. Here the
/// target (this test, playing node 1) refuses the first part with an
/// answer it holds back while it acknowledges every part, naming the
/// refusal in its horizon: the notifying part must not go while that
/// answer is missing, and once it arrives the write fails with it.
#[test]
fn a_notifying_part_waits_for_the_answers_to_earlier_parts() {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let dev = device(0, &ports, 1, &["--peer-timeout", "5s"]);
    let ctx = Context::open(dev.socket(0), config()).unwrap();
    const LEN: usize = 16 << 10;
    let buf = ctx.alloc(LEN, 4096).unwrap();
    buf.write_at(0, &fill(LEN, 3));
    let region = ctx.register_buffer(&buf).unwrap();
    let window = ctx
        .bind_window(&region, 0, LEN as u64, Access::REMOTE_READ)
        .unwrap();
    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    // Handshake: a read of 0 bytes.
    me.request(&read_message(origin(1, 1), 0, window.remote().key, 0, 0));
    me.settle();
    me.pump(Duration::from_millis(50));
    assert!(me.dev_inc != 0);

    let kinds = |me: &Raw| -> Vec<Option<u64>> {
        me.inbox
            .iter()
            .filter_map(|(_, _, p)| match Message::decode(p) {
                Ok(Message::VectorWrite { notice, .. }) => Some(notice.map(|n| n.immediate)),
                _ => None,
            })
            .collect()
    };
    // The seq of the refusal, taken before any part arrives: every
    // acknowledgement of a part names it in its horizon, though nothing
    // is sent on it until the test says so.
    let held = me.next[1];
    me.next[1] += 1;
    let player = std::thread::spawn(move || {
        // Wait for the first part; acknowledge every part while the
        // refusal of the first is held back.
        let deadline = Instant::now() + Duration::from_secs(10);
        let first = loop {
            me.pump(Duration::from_millis(1));
            let found = me
                .inbox
                .iter()
                .find_map(|(_, _, p)| match Message::decode(p) {
                    Ok(Message::VectorWrite { origin, .. }) => Some(origin.tag),
                    _ => None,
                });
            if let Some(tag) = found {
                break tag;
            }
            assert!(Instant::now() < deadline, "no part arrived");
        };
        let refusal = encode(Message::Result {
            tag: first,
            status: Status::RemoteAccessError,
            detail: ErrorDetail::NotGranted,
            value: 0,
        });
        me.pump(Duration::from_millis(400));
        let before = kinds(&me);
        // The refusal goes now.
        me.unacked.push((1, held, refusal.clone()));
        me.put(Some((1, held)), &refusal);
        me.pump(Duration::from_millis(400));
        (before, kinds(&me))
    });
    let write = Vector::write(
        region.local(0, LEN as u32).unwrap(),
        Pattern::contiguous(LEN as u64),
        RemoteAddress {
            node: 1,
            port: 0,
            key: RemoteKey(0x5eed_1234),
            offset: 0,
        },
        Pattern::contiguous(LEN as u64),
    )
    .unwrap()
    .notify(0xabc);
    let done = run_entry(&ctx, write.build(), Duration::from_secs(20));
    let (before, after) = player.join().unwrap();
    println!("parts before the refusal: {before:?}; after: {after:?}; completion {done:?}");
    assert!(before.len() >= 2, "a write of several parts: {before:?}");
    assert!(
        before.iter().all(Option::is_none),
        "the notifying part went while an answer to an earlier part was missing: {before:?}"
    );
    assert!(
        after.iter().all(Option::is_none),
        "a notifying part of a refused write: {after:?}"
    );
    let done = done.expect("the write completes");
    assert_eq!(
        (done.status, done.detail),
        (Status::RemoteAccessError, ErrorDetail::NotGranted),
        "{done:?}"
    );
}

/// An ATOMIC_TO held for the check of its destination on a silent node,
/// whose frontend leaves (and a new one takes the port) before the check
/// fails: the request is dropped with its frontend, counted as failed, so
/// that the link's counters add up again (requests started = completed +
/// failed) and nothing lands in the new frontend's memory.
#[test]
fn a_held_request_whose_frontend_left_is_counted() {
    let ports = [common::free_udp_port(), common::free_udp_port()];
    let dev = device(0, &ports, 1, &["--peer-timeout", "1s"]);
    // Silent: node 1's socket is bound, nothing is ever answered.
    let mut me = Raw::new(1, ports[1], 0, ports[0]);
    me.silent = true;
    let ctx = Context::open(dev.socket(0), config()).unwrap();
    let buf = ctx.alloc(4096, 64).unwrap();
    let region = ctx.register_buffer(&buf).unwrap();
    let window = ctx
        .bind_window(
            &region,
            0,
            4096,
            Access::REMOTE_ATOMIC | Access::REMOTE_WRITE,
        )
        .unwrap();
    let destination = RemoteAddress {
        node: 1,
        port: 0,
        key: RemoteKey(0x77),
        offset: 0,
    };
    {
        let mut cq: CompletionQueue<'_> = ctx.create_completion_queue();
        let mut qp = ctx.create_queue_pair(&mut cq).unwrap();
        let atomic = AtomicTo::new(
            window.remote().at(64),
            AtomicOp::FetchAdd { add: 1 },
            destination,
        );
        qp.post(&[atomic.build().signaled()]).unwrap();
        // Held by the link for its check (node 1 acknowledges nothing).
        let deadline = Instant::now() + Duration::from_secs(5);
        while dev.fabric_status().n("started") == 0 {
            assert!(
                Instant::now() < deadline,
                "the request never reached the link"
            );
            me.pump(Duration::from_millis(5));
        }
    }
    drop(window);
    drop(region);
    drop(ctx);
    // A new frontend on the port.
    let fresh = Context::open(dev.socket(0), config()).unwrap();
    let fresh_buf = fresh.alloc(4096, 64).unwrap();
    fresh_buf.write_at(0, &[0x11; 4096]);
    let fresh_region = fresh.register_buffer(&fresh_buf).unwrap();
    // The check fails once node 1 is gone (a second of silence); the
    // counters then add up.
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        me.pump(Duration::from_millis(20));
        let status = dev.fabric_status();
        if status.n("completed") + status.n("failed") == status.n("started") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "requests started {} never all ended: completed {}, failed {}",
            status.n("started"),
            status.n("completed"),
            status.n("failed")
        );
    };
    assert_eq!(
        (status.n("started"), status.n("failed")),
        (1, 1),
        "{status:?}"
    );
    assert!(contents(&fresh_buf).iter().all(|&b| b == 0x11));
    drop(fresh_region);
}
