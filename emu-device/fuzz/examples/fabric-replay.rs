//! Replays inputs of the `fabric_endpoint` fuzz target, printing each
//! operation before it runs: `cargo run --example fabric-replay -- FILE..`.

fn main() -> std::io::Result<()> {
    for path in std::env::args().skip(1) {
        eprintln!("== {path}");
        let data = std::fs::read(&path)?;
        pindown_emu_device_fuzz::fabric::World::run_traced(&data, true);
    }
    Ok(())
}
