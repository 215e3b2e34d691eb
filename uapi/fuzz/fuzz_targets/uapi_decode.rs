//! The device ABI's decoders on hostile bytes: a work request the device
//! reads from a send queue, a completion the driver reads from a completion
//! queue, both as stamped queue slots too, an opcode byte and the QUERY
//! value. Decoding never panics; what decodes encodes back to the same
//! bytes (unused fields must be zero, so the encoding is canonical) and
//! decodes again to the same value.
//!
//! Input: one selector byte, then the bytes handed to the decoder.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use libfuzzer_sys::fuzz_target;
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
}

impl<'a> Arbitrary<'a> for Input<'a> {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        // An explicit selector byte (not the derive's u32) keeps seed files
        // easy to write: see examples/make-seeds.rs.
        Ok(match u8::arbitrary(u)? % 6 {
            0 => Input::WorkRequest(u.bytes(u.len())?),
            1 => Input::Completion(u.bytes(u.len())?),
            2 => Input::Opcode(u8::arbitrary(u)?),
            3 => Input::DeviceInfo(u64::arbitrary(u)?),
            4 => Input::RequestSlot(<[u8; queue::REQUEST_SLOT]>::arbitrary(u)?),
            _ => Input::CompletionSlot(<[u8; queue::COMPLETION_SLOT]>::arbitrary(u)?),
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
        let info = DeviceInfo::from_value(value);
        assert_eq!(DeviceInfo::from_value(info.to_value()), info);
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
});
