//! The device ABI's decoders on hostile bytes: a work request the device
//! reads from a send queue, a completion the driver reads from a completion
//! queue, both as stamped queue slots too, an opcode byte, the QUERY
//! value, and a vector transfer's descriptor (a pair of access patterns,
//! whose lists in memory are read from the input's tail and which are then
//! planned and walked). Decoding never panics; what decodes encodes back
//! to the same bytes (unused fields must be zero, so the encoding is
//! canonical) and decodes again to the same value; a plan's walk stays
//! inside its hull and yields exactly the bytes it covers.
//!
//! Input: one selector byte, then the bytes handed to the decoder.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
use pindown_uapi::pattern::{decode_pair, encode_pair, Pattern};
use pindown_uapi::queue;
use pindown_uapi::{Completion, DeviceInfo, Opcode, WorkRequest};

#[derive(Debug)]
enum Input<'a> {
    WorkRequest(&'a [u8]),
    Completion(&'a [u8]),
    Opcode(u8),
    DeviceInfo(u64),
    RequestSlot([u8; queue::REQUEST_SLOT]),
    CompletionSlot([u8; queue::COMPLETION_SLOT]),
    /// A descriptor, then the bytes lists in memory read as.
    PatternPair(&'a [u8], &'a [u8]),
}

impl<'a> Arbitrary<'a> for Input<'a> {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        // An explicit selector byte (not the derive's u32) keeps seed files
        // easy to write: see examples/make-seeds.rs.
        Ok(match u8::arbitrary(u)? % 7 {
            0 => Input::WorkRequest(u.bytes(u.len())?),
            1 => Input::Completion(u.bytes(u.len())?),
            2 => Input::Opcode(u8::arbitrary(u)?),
            3 => Input::DeviceInfo(u64::arbitrary(u)?),
            4 => Input::RequestSlot(<[u8; queue::REQUEST_SLOT]>::arbitrary(u)?),
            5 => Input::CompletionSlot(<[u8; queue::COMPLETION_SLOT]>::arbitrary(u)?),
            _ => {
                let len = usize::from(u16::arbitrary(u)?).min(u.len());
                Input::PatternPair(u.bytes(len)?, u.bytes(u.len())?)
            }
        })
    }
}

fuzz_target!(|input: Input<'_>| match input {
    Input::WorkRequest(bytes) => {
        if let Ok(wr) = WorkRequest::decode(bytes) {
            let encoded = wr.encode();
            assert_eq!(&encoded[..], &bytes[..WorkRequest::SIZE], "{wr:?}");
            assert_eq!(WorkRequest::decode(&encoded), Ok(wr));
        }
    }
    Input::Completion(bytes) => {
        if let Ok(c) = Completion::decode(bytes) {
            let encoded = c.encode();
            assert_eq!(&encoded[..], &bytes[..Completion::SIZE], "{c:?}");
            assert_eq!(Completion::decode(&encoded), Ok(c));
        }
    }
    Input::Opcode(code) => {
        if let Ok(op) = Opcode::from_u8(code) {
            assert_eq!(op as u8, code);
        }
    }
    Input::DeviceInfo(value) => {
        let info = DeviceInfo::from_query((value >> 40) as u32, value);
        let (byte_len, value) = info.to_query();
        assert_eq!(DeviceInfo::from_query(byte_len, value), info);
    }
    Input::RequestSlot(slot) => {
        if let Ok(wr) = queue::decode_request_slot(&slot) {
            let position = queue::request_slot_stamp(&slot).wrapping_sub(1);
            assert_eq!(queue::request_slot(&wr, position), slot, "{wr:?}");
        }
    }
    Input::CompletionSlot(slot) => {
        if let Ok(c) = queue::decode_completion_slot(&slot) {
            let stamp = &slot[queue::COMPLETION_STAMP..];
            let position = u16::from_le_bytes([stamp[0], stamp[1]]).wrapping_sub(1);
            assert_eq!(queue::completion_slot(&c, position), slot, "{c:?}");
        }
    }
    Input::PatternPair(descriptor, memory) => {
        if let Ok((local, remote)) = decode_pair(descriptor) {
            assert_eq!(encode_pair(&local, &remote), descriptor);
            for mut pattern in [local, remote] {
                // Lists in memory read from the tail of the input, cycled
                // (a bound small enough to keep a run short).
                let resolved = pattern.resolve_lists(256, &mut |iova, out: &mut [u8]| {
                    if memory.is_empty() {
                        return false;
                    }
                    for (i, byte) in out.iter_mut().enumerate() {
                        *byte = memory[(iova as usize).wrapping_add(i) % memory.len()];
                    }
                    true
                });
                if resolved.is_ok() {
                    walk(&pattern);
                }
            }
        }
    }
});

/// Plans `pattern` and walks a bounded part of it, from the start and
/// from the middle: every segment lies inside the hull, and a walk yields
/// the bytes asked for (no more, and all of them unless bounded).
fn walk(pattern: &Pattern) {
    let Ok(plan) = pattern.plan() else {
        return;
    };
    let len = plan.len();
    for from in [0, len / 2] {
        let want = (len - from).min(1 << 16);
        let mut got = 0u64;
        for (count, segment) in plan.segments(from, want).enumerate() {
            let (low, high) = plan.hull().expect("a pattern with bytes has a hull");
            assert!(segment.len > 0);
            assert!(segment.offset >= low, "{segment:?} below {low}");
            assert!(
                i128::from(segment.offset) + i128::from(segment.len) <= i128::from(high),
                "{segment:?} past {high}"
            );
            got += segment.len;
            if count > 4096 {
                return;
            }
        }
        assert_eq!(got, want, "{pattern:?} from {from}");
        // A slice walks the same bytes.
        let slice = plan.slice(from, want);
        if let Ok(sliced) = slice.plan() {
            let mut a = plan.segments(from, want);
            let mut b = sliced.segments(0, want);
            for _ in 0..64 {
                match (a.next(), b.next()) {
                    (Some(x), Some(y)) => assert_eq!(x, y, "{pattern:?} sliced at {from}"),
                    (None, None) => break,
                    other => panic!("walks differ: {other:?}"),
                }
            }
        }
    }
}
