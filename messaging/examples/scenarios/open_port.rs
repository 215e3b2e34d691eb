//! Opening a rank's port as the example rank programs do.

use std::path::Path;
use std::time::{Duration, Instant};

use pindown_driver::verbs::Context;

/// Opens the port at `socket` with the messaging settings. The launchers
/// start ranks once the device's socket files exist, and a loaded machine
/// may still be between bind and listen: a refused open is tried again
/// for up to 10 s.
pub fn open(socket: &Path) -> Result<Context, String> {
    let started = Instant::now();
    loop {
        match Context::open(socket, pindown_messaging::context_config()) {
            Ok(context) => return Ok(context),
            Err(e) if started.elapsed() < Duration::from_secs(10) => {
                if std::env::var_os("RANK_TRACE").is_some() {
                    eprintln!("opening {}: {e}; trying again", socket.display());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("{}: {e}", socket.display())),
        }
    }
}
