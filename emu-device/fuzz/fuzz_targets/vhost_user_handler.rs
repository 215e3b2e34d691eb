//! The request handler on a hostile frontend: a sequence of messages (see
//! the input format in `src/lib.rs`) applied to a fresh port whose frontend
//! set a small memfd-backed memory table. Nothing panics or crashes; every
//! reply is a well-formed reply to the request it answers; a request that
//! asked for a reply gets one.

#![no_main]

use arbitrary::Unstructured;
use pindown_emu_device::vhost_user::conn::RawMessage;
use pindown_emu_device::vhost_user::handler;
use pindown_emu_device::vhost_user::message::{Header, HEADER_SIZE};
use pindown_emu_device_fuzz::{init, next_message, port_with_memory, start_input};
use libfuzzer_sys::fuzz_target;
use vhost::vhost_user::message::VhostUserHeaderFlag;

fuzz_target!(init: init(), |data: &[u8]| {
    start_input();
    let mut u = Unstructured::new(data);
    let (mut state, stats) = port_with_memory();
    let rings = state.vrings.len();
    while let Ok(msg) = next_message(&mut u) {
        // The connection loop drops a frontend whose header is malformed.
        let Ok(header) = Header::decode(&msg.header) else {
            break;
        };
        let raw = RawMessage {
            header,
            payload: msg.payload,
            files: msg.files,
        };
        let Ok(out) = handler::handle(&mut state, &stats, raw) else {
            // Malformed payload: the connection loop drops the frontend.
            break;
        };
        if header.need_reply() {
            assert!(out.reply.is_some(), "no reply to {header:?}");
        }
        if let Some(reply) = out.reply {
            let h = Header::decode(&reply).expect("a well-formed reply header");
            assert_eq!(h.request, header.request);
            assert_ne!(h.flags & VhostUserHeaderFlag::REPLY.bits(), 0);
            assert_eq!(h.size as usize, reply.len() - HEADER_SIZE);
        }
        assert_eq!(state.vrings.len(), rings, "the port's rings are fixed");
    }
});
