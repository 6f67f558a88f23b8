//! Attach mode (`--pid`): what cannot be observed is refused with a clear
//! line, never measured as if it were a user process.

mod common;

use std::process::Command;

use common::*;

#[test]
fn a_kernel_thread_is_refused() {
    assert_root();
    // PID 2 is kthreadd on Linux; checked from its own stat flags (PF_KTHREAD).
    let stat = std::fs::read_to_string("/proc/2/stat").expect("/proc/2/stat");
    let flags: u64 = stat.rsplit_once(')').unwrap().1.split_whitespace().nth(6).unwrap().parse().unwrap();
    assert_ne!(flags & 0x0020_0000, 0, "PID 2 is not a kernel thread here: {stat}");
    let out = Command::new(OBSERVER).args(["run", "--pid", "2"]).output().expect("run observer");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("PID 2 is a kernel thread"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}
