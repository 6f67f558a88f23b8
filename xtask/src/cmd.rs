//! Running commands with errors that say which command failed.

use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail};

fn describe(c: &Command) -> String {
    let mut s = c.get_program().to_string_lossy().into_owned();
    for a in c.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Run, inheriting stdio; fail on a non-zero exit.
pub fn run(c: &mut Command) -> Result<()> {
    let d = describe(c);
    eprintln!("+ {d}");
    let st = c.status().with_context(|| format!("cannot run `{d}`"))?;
    if !st.success() {
        bail!("`{d}` failed ({st})");
    }
    Ok(())
}

/// [`run`], returning the CPU time (s) of the command and every descendant it waited for, from
/// its own `wait4` rusage: right even while other children of this process run beside it.
pub fn run_cpu(c: &mut Command) -> Result<f64> {
    let d = describe(c);
    eprintln!("+ {d}");
    let child = c.spawn().with_context(|| format!("cannot run `{d}`"))?;
    let (mut status, pid) = (0i32, child.id() as libc::pid_t);
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let r = loop {
        // SAFETY: waits for our own child, filling the status and rusage we own.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break r;
        }
    };
    if r < 0 {
        bail!("waiting for `{d}`: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("`{d}` failed (wait status {status:#x})");
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Ok(tv(ru.ru_utime) + tv(ru.ru_stime))
}

/// Run and capture stdout+stderr; returns the output even on failure.
pub fn capture(c: &mut Command) -> Result<Output> {
    let d = describe(c);
    c.stdin(Stdio::null()).output().with_context(|| format!("cannot run `{d}`"))
}

/// Whether a program is found on PATH.
pub fn on_path(prog: &str) -> bool {
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file())).unwrap_or(false)
}

/// Output of a command that must succeed, as UTF-8 (stderr shown on failure).
pub fn output(c: &mut Command) -> Result<String> {
    let out = c.output().with_context(|| format!("cannot run `{}`", describe(c)))?;
    if !out.status.success() {
        bail!("`{}` failed: {}\n{}", describe(c), out.status, String::from_utf8_lossy(&out.stderr));
    }
    String::from_utf8(out.stdout).with_context(|| format!("`{}` printed non-UTF-8", describe(c)))
}

/// User + system CPU seconds of waited-for children so far.
pub fn children_cpu() -> f64 {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}
