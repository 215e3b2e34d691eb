//! The fabric's reliable-datagram endpoint and message decoders on hostile
//! input: two endpoints exchange messages over a wire the input drives
//! (loss, duplication, reordering, corruption, time jumps up to days, a
//! restart) while a hostile sender speaks to one of them with raw bytes
//! and forged headers (see `src/fabric.rs` for the input format and the
//! checks: deliveries at most once and byte-exact, every send ended at
//! most once, room for a reply to every request delivered, codecs that
//! round-trip).

#![no_main]

use libfuzzer_sys::fuzz_target;
use pindown_emu_device_fuzz::fabric::World;

fuzz_target!(|data: &[u8]| {
    World::run(data);
});
