//! The vhost-user message parser on hostile input: a header, its payload
//! and the files sent with it, as a frontend delivers them (see the input
//! format in `src/lib.rs`). Decoding never panics; a decoded header encodes
//! back to its bytes; a decoded IOTLB message round-trips.

#![no_main]

use arbitrary::Unstructured;
use pindown_emu_device::vhost_user::message::{self, Header, Request};
use pindown_uapi::IotlbMessage;
use pindown_emu_device_fuzz::{init, next_message, start_input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: init(), |data: &[u8]| {
    start_input();
    let mut u = Unstructured::new(data);
    let Ok(msg) = next_message(&mut u) else {
        return;
    };
    let Ok(header) = Header::decode(&msg.header) else {
        return;
    };
    assert_eq!(header.encode(), msg.header);
    if let Ok(Request::Iotlb(m)) = message::decode(&header, &msg.payload, msg.files) {
        assert_eq!(IotlbMessage::decode(&m.encode()), Ok(m));
    }
});
