//! `emu-device`: the emulated pindown NIC, a vhost-user-net backend process.

fn main() -> std::process::ExitCode {
    pindown_emu_device::cli::main(std::env::args_os())
}
