//! Bad input and missing privileges give one clear line and a non-zero exit.

mod common;

use std::process::Command;

use common::*;

fn stderr_of(c: &mut Command) -> (i32, String) {
    let out = c.output().expect("run observer");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn unknown_pid() {
    assert_root();
    let (code, err) = stderr_of(Command::new(OBSERVER).args(["run", "--pid", "999999999"]));
    assert_ne!(code, 0);
    assert!(err.contains("no process with PID 999999999"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn command_not_found() {
    assert_root();
    let (code, err) = stderr_of(Command::new(OBSERVER).args(["run", "--", "/no/such/program"]));
    assert_ne!(code, 0);
    assert!(err.contains("/no/such/program"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn nothing_to_observe() {
    let (code, err) = stderr_of(Command::new(OBSERVER).args(["run"]));
    assert_ne!(code, 0);
    assert!(err.contains("--pid"), "{err}");
}

#[test]
fn unprivileged_user_is_told_what_to_do() {
    assert_root();
    // Drop to `nobody` with no capabilities (setpriv is in util-linux).
    let (code, err) = stderr_of(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", OBSERVER, "run", "--", "true"]),
    );
    assert_ne!(code, 0);
    assert!(err.contains("CAP_BPF") && err.contains("root"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}
