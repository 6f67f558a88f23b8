//! `workload`: small, well-understood programs that exercise one part of the
//! memory system each, and report what they did as measured by themselves
//! (`getrusage`, their own clock). The observer's tests compare its numbers with
//! these; `cargo xtask demo` uses them before the engine is involved.
//!
//! Output: one JSON object on stdout, e.g.
//! `{"kind":"file-refault","pages":65536,"wall_ns":…,"majflt":…,"minflt":…}` where
//! `majflt`/`minflt`/`wall_ns` are deltas around the measured loop only.

use std::{io::Write, os::fd::AsRawFd, time::Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "workload", about = "Reference workloads for the observer's tests")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Write a file, evict it from the page cache, map it and read one byte per page.
    FileRefault {
        #[arg(long)]
        path: std::path::PathBuf,
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        size: u64,
        /// Keep the file afterwards (default: remove it).
        #[arg(long)]
        keep: bool,
    },
    /// Touch fresh anonymous memory, one write per page (no huge pages).
    Anon {
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        size: u64,
        /// Split the pages over this many threads.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        /// Map, touch and unmap this many times (the size is per round).
        #[arg(long, default_value_t = 1)]
        repeat: u32,
        /// Sleep this long before measuring (lets an observer attach).
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// Both of the above, for the demo.
    Demo {
        #[arg(long)]
        path: std::path::PathBuf,
        #[arg(long, default_value = "128M", value_parser = parse_size)]
        size: u64,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("not a size: {s:?} (use e.g. 256M)"))
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

#[derive(Debug, Clone, Copy)]
struct Usage {
    majflt: i64,
    minflt: i64,
}

fn usage() -> Usage {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    Usage { majflt: ru.ru_majflt, minflt: ru.ru_minflt }
}

struct Measured {
    kind: &'static str,
    pages: u64,
    wall_ns: u128,
    before: Usage,
    after: Usage,
}

impl Measured {
    fn json(&self) -> String {
        format!(
            "{{\"kind\":\"{}\",\"pages\":{},\"wall_ns\":{},\"majflt\":{},\"minflt\":{}}}",
            self.kind,
            self.pages,
            self.wall_ns,
            self.after.majflt - self.before.majflt,
            self.after.minflt - self.before.minflt
        )
    }
}

/// A private mapping that is unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from a successful mmap.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn mmap(len: usize, prot: i32, flags: i32, fd: i32) -> Result<Mapping> {
    // SAFETY: a fresh mapping chosen by the kernel.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error()).context("mmap");
    }
    Ok(Mapping { ptr: p.cast(), len })
}

fn file_refault(path: &std::path::Path, size: u64, keep: bool) -> Result<Measured> {
    let ps = page_size();
    {
        let mut f = std::fs::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let chunk = vec![0x5au8; 1 << 20];
        let mut left = size;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n]).with_context(|| format!("writing {}", path.display()))?;
            left -= n as u64;
        }
        f.sync_all().context("fsync")?;
    }
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let fd = f.as_raw_fd();
    // SAFETY: valid fd.
    let rc = unsafe { libc::posix_fadvise(fd, 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise(DONTNEED) failed: {}", std::io::Error::from_raw_os_error(rc));
    }
    let len = size as usize;
    let m = mmap(len, libc::PROT_READ, libc::MAP_PRIVATE, fd)?;
    // No readahead: every page is its own major fault.
    // SAFETY: the range is our mapping.
    unsafe { libc::madvise(m.ptr.cast(), len, libc::MADV_RANDOM) };
    let before = usage();
    let t0 = Instant::now();
    let mut sum = 0u64;
    let mut off = 0;
    while off < len {
        // SAFETY: off < len, inside the mapping.
        sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(m.ptr.add(off)) } as u64);
        off += ps;
    }
    let wall_ns = t0.elapsed().as_nanos();
    let after = usage();
    std::hint::black_box(sum);
    drop(m);
    if !keep {
        let _ = std::fs::remove_file(path);
    }
    Ok(Measured { kind: "file-refault", pages: (len / ps) as u64, wall_ns, before, after })
}

fn anon(size: u64, threads: usize, repeat: u32, delay_ms: u64) -> Result<Measured> {
    let ps = page_size();
    let len = size as usize;
    let threads = threads.max(1);
    std::thread::sleep(std::time::Duration::from_millis(delay_ms));
    let before = usage();
    let t0 = Instant::now();
    for _ in 0..repeat {
        let m = mmap(len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)?;
        // SAFETY: the range is our mapping.
        unsafe { libc::madvise(m.ptr.cast(), len, libc::MADV_NOHUGEPAGE) };
        let pages = len / ps;
        let per = pages.div_ceil(threads);
        let base = m.ptr as usize;
        std::thread::scope(|sc| {
            for t in 0..threads {
                let (lo, hi) = (t * per, ((t + 1) * per).min(pages));
                sc.spawn(move || {
                    for p in lo..hi {
                        // SAFETY: p < pages, inside the writable mapping.
                        unsafe { std::ptr::write_volatile((base + p * ps) as *mut u8, 1) };
                    }
                });
            }
        });
        drop(m);
    }
    let wall_ns = t0.elapsed().as_nanos();
    let after = usage();
    Ok(Measured { kind: "anon", pages: (len / ps) as u64 * repeat as u64, wall_ns, before, after })
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::FileRefault { path, size, keep } => file_refault(&path, size, keep).map(|m| vec![m]),
        Cmd::Anon { size, threads, repeat, delay_ms } => anon(size, threads, repeat, delay_ms).map(|m| vec![m]),
        Cmd::Demo { path, size } => {
            file_refault(&path, size, false).and_then(|a| anon(size, 1, 1, 0).map(|b| vec![a, b]))
        }
    };
    match r {
        Ok(ms) => {
            for m in ms {
                println!("{}", m.json());
            }
        }
        Err(e) => {
            eprintln!("workload: error: {e:#}");
            std::process::exit(1);
        }
    }
}
