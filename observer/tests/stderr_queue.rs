//! stderr's queue behind a reader that stalls (`observer::stderr`), on this test process's own
//! stderr: its file descriptor 2 is a pipe of one page that nobody reads until every line has been
//! sent. The one test of this binary owns fd 2 (the queue is process-wide).
//!
//! What it checks, against the test's own counts of the lines it sent: every token line and every
//! diagnostic is printed or counted in the notes said when the writer catches up; diagnostics keep
//! the last quarter of the queue while token lines are skipped.

use std::{
    fs::File,
    io::Read,
    os::fd::{AsRawFd, FromRawFd},
};

use observer::stderr::{self, QUEUE_LINES, Queued};

mod common;
use common::said_not_printed;

const TOKENS: u64 = 5000;
const DIAGNOSTICS: u64 = 600;

/// `fd` made to be `target`, or the OS error naming the step.
fn dup2(fd: i32, target: i32, what: &str) {
    // SAFETY: plain system call on descriptors this process owns.
    let r = unsafe { libc::dup2(fd, target) };
    assert!(r >= 0, "{what}: {}", std::io::Error::last_os_error());
}

#[test]
fn every_line_is_printed_or_counted_and_diagnostics_keep_their_quarter() {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both are fresh descriptors owned here from now on.
    let (mut reader, writer) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    // One page: the writer thread blocks after a few dozen lines.
    // SAFETY: fcntl on an owned descriptor.
    let size = unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    assert!(size > 0, "F_SETPIPE_SZ: {}", std::io::Error::last_os_error());
    // SAFETY: dup of fd 2, which this process has.
    let saved = unsafe { libc::dup(2) };
    assert!(saved >= 0, "dup(2): {}", std::io::Error::last_os_error());
    dup2(writer.as_raw_fd(), 2, "fd 2 onto the pipe");

    let guard = Queued::begin();
    let pad = "x".repeat(80);
    for i in 0..TOKENS {
        stderr::token_line(format!("T {i} {pad}"));
    }
    for i in 0..DIAGNOSTICS {
        stderr::diagnostic(format!("D {i} {pad}"));
    }
    // Now read it all: the writer catches up, says its counts, and the drain returns.
    let collect = std::thread::spawn(move || {
        let mut text = String::new();
        reader.read_to_string(&mut text).map(|_| text)
    });
    stderr::drain();
    drop(guard);
    dup2(saved, 2, "fd 2 back");
    // SAFETY: `saved` is ours and no longer needed.
    unsafe { libc::close(saved) };
    drop(writer);
    let text = collect.join().unwrap().expect("reading the pipe");

    let printed = |p: &str| text.lines().filter(|l| l.starts_with(p)).count() as u64;
    let (tokens, diagnostics) = (printed("T "), printed("D "));
    let (skipped_tokens, skipped_diagnostics) =
        (said_not_printed(&text, "token lines"), said_not_printed(&text, "diagnostics"));
    eprintln!(
        "token lines: {tokens} printed, {skipped_tokens} said not printed; diagnostics: {diagnostics} printed, \
         {skipped_diagnostics} said not printed"
    );
    assert_eq!(tokens + skipped_tokens, TOKENS, "every token line printed or counted");
    assert_eq!(diagnostics + skipped_diagnostics, DIAGNOSTICS, "every diagnostic printed or counted");
    assert!(skipped_tokens > 0 && skipped_diagnostics > 0, "the queue filled for both kinds");
    // The queue held three quarters of token lines when the diagnostics came: the last quarter
    // was theirs.
    let quarter = (QUEUE_LINES / 4) as u64;
    assert!(diagnostics >= quarter, "diagnostics printed {diagnostics}, fewer than the queue's last quarter {quarter}");
    // In order: no token line after the first diagnostic but the notes.
    let first_d = text.lines().position(|l| l.starts_with("D ")).unwrap();
    assert!(!text.lines().skip(first_d).any(|l| l.starts_with("T ")), "token lines after a diagnostic");
}
