//! The unmap monitor without CAP_SYS_PTRACE: where a process may not
//! handle kernel-mode faults (`vm.unprivileged_userfaultfd` = 0, the
//! default of current kernels), the monitor opens a userfaultfd for
//! user-mode faults only and still catches unmaps. The parent starts this
//! test binary again with CAP_SYS_PTRACE dropped from its bounding set
//! (as root; an exec then leaves it out of every set), and the child
//! checks the monitor there.

mod common;

use std::os::unix::process::CommandExt;
use std::process::Command;

use pindown_pincache::{CacheConfig, MemoryMonitor, Monitor, NoopPinner, PinCache};

const PAGE: usize = 4096;
/// `CAP_SYS_PTRACE` (linux/capability.h).
const CAP_SYS_PTRACE: libc::c_int = 19;

/// The child: runs without CAP_SYS_PTRACE.
#[test]
#[ignore = "the child process: the other test of this file starts it with --ignored"]
fn monitor_without_ptrace_child() {
    check_monitor_without_ptrace();
}

/// Checks that the monitor catches an unmap; the process must not hold
/// CAP_SYS_PTRACE.
fn check_monitor_without_ptrace() {
    assert!(!has_ptrace(), "CAP_SYS_PTRACE was dropped");
    let monitor = MemoryMonitor::global().expect("the monitor without CAP_SYS_PTRACE");
    let cache = PinCache::new(
        NoopPinner,
        CacheConfig {
            monitor: Monitor::Required,
            ..CacheConfig::default()
        },
    )
    .expect("a monitored cache");
    assert!(cache.monitored());
    let len = 4 * PAGE;
    let buffer = common::map_anonymous(len);
    drop(cache.pin(buffer as usize, len).unwrap());
    let events_before = monitor.events_seen();
    common::unmap_plain(buffer, len);
    let again = common::map_anonymous_at(buffer, len);
    drop(cache.pin(buffer as usize, len).unwrap());
    let stats = cache.stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.invalidations),
        (0, 2, 1),
        "the unmap was caught: the stale region was not hit"
    );
    assert!(monitor.events_seen() > events_before);
    drop(cache);
    common::unmap_plain(again, len);
    println!("monitor ran without CAP_SYS_PTRACE");
}

/// Whether this process holds CAP_SYS_PTRACE (effective).
fn has_ptrace() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .map(|hex| u64::from_str_radix(hex.trim(), 16).unwrap())
        .unwrap();
    effective & (1 << CAP_SYS_PTRACE) != 0
}

#[test]
fn the_unmap_monitor_runs_without_cap_sys_ptrace() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // Not root, so without the capability: the child's case is this
        // process's.
        return check_monitor_without_ptrace();
    }
    let restricted = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .map(|value| value.trim() == "0")
        .unwrap_or(true);
    let mut child = Command::new(std::env::current_exe().unwrap());
    child.args([
        "--exact",
        "monitor_without_ptrace_child",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    // SAFETY: between fork and exec the closure makes one system call,
    // which is async-signal-safe, and touches no memory of the parent's.
    unsafe {
        child.pre_exec(|| {
            if libc::prctl(libc::PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("monitor ran without CAP_SYS_PTRACE"),
        "the child (vm.unprivileged_userfaultfd restricted: {restricted}) failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
