//! Bad command lines fail with a clear message, never a panic.

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pindown-emu-device"))
        .args(args)
        .output()
        .expect("run emu-device");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_arguments_are_reported() {
    let (ok, err) = run(&[]);
    assert!(!ok);
    assert!(err.contains("--socket"), "{err}");

    let (ok, err) = run(&["--socket", "/tmp/x.sock", "--mac-base", "zz:00"]);
    assert!(!ok);
    assert!(err.contains("MAC"), "{err}");

    let (ok, err) = run(&["--socket", "/tmp/x.sock", "--queue-size-max", "1000"]);
    assert!(!ok);
    assert!(err.contains("power of two"), "{err}");

    let (ok, err) = run(&["--socket", "/tmp/x.sock", "--queue-pairs", "0"]);
    assert!(!ok);
    assert!(err.contains("queue-pairs"), "{err}");

    // A path that exists and is not a socket is not clobbered.
    let file = std::env::temp_dir().join(format!("emu-device-cli-{}", std::process::id()));
    std::fs::write(&file, b"keep me").unwrap();
    let (ok, err) = run(&["--socket", file.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    std::fs::remove_file(&file).unwrap();
    assert!(!err.contains("panicked"));
}
