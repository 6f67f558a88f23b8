//! `workload`: small, well-understood programs that exercise one part of the
//! memory system or the scheduler each, and report what they did as measured
//! by themselves (`getrusage`, their own clock). The observer's tests compare
//! its numbers with these; `cargo xtask demo` uses them too.
//!
//! Each measured phase runs inside one *marked token*: the workload exports
//! the engine marker symbols (`observer::engine_abi`) and calls them around
//! the phase, so the observer sees it as a token.
//!
//! Output: one JSON object per phase on stdout, e.g.
//! `{"kind":"file-refault","index":0,"pages":65536,"wall_ns":…,"majflt":…,"minflt":…,"utime_ns":…,
//! "stime_ns":…,"sched_cpu_ns":…,"sched_wait_ns":…}` where the numbers are deltas around the
//! phase only (`sched_*`: the calling thread's on-CPU time and run-queue wait from
//! `/proc/thread-self/schedstat`, the scheduler's own accounting).

use std::{
    io::Write,
    os::{fd::AsRawFd, unix::fs::OpenOptionsExt},
    time::Instant,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use observer::engine_abi::TokenRecordV1;

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
    /// Spin on the CPU in user mode.
    Busy {
        #[arg(long, default_value_t = 1000)]
        ms: u64,
    },
    /// Sleep (nanosleep).
    Sleep {
        #[arg(long, default_value_t = 1000)]
        ms: u64,
    },
    /// O_DIRECT preads of a file written first; reports the time around the reads.
    PreadDirect {
        #[arg(long)]
        path: std::path::PathBuf,
        #[arg(long, default_value = "128M", value_parser = parse_size)]
        size: u64,
        #[arg(long, default_value = "1M", value_parser = parse_size)]
        block: u64,
    },
    /// Fill an anonymous buffer, push it out (a balloon under a memory limit,
    /// and/or MADV_PAGEOUT), then touch it again inside one token.
    Swap {
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        size: u64,
        /// Anonymous memory touched after the buffer, to push it out under a cgroup limit.
        #[arg(long, default_value = "0", value_parser = parse_size)]
        balloon: u64,
        /// Ask the kernel to page the buffer out (MADV_PAGEOUT, Linux >= 5.4).
        #[arg(long)]
        pageout: bool,
    },
    /// Many short tokens, like a decode loop: each spins `--ms` in user mode,
    /// writes `--anon` bytes of fresh anonymous pages (minor faults) and, with
    /// `--path`, reads `--file-pages` pages of an evicted file (major faults).
    /// Its marker record reports `compute_ns` as an engine that times nothing
    /// would: wall time minus the (zero) time it timed.
    Tokens {
        #[arg(long, default_value_t = 100)]
        n: u64,
        #[arg(long, default_value_t = 10)]
        ms: u64,
        #[arg(long, default_value = "256K", value_parser = parse_size)]
        anon: u64,
        #[arg(long)]
        path: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 16)]
        file_pages: u64,
        /// Sleep this long before the first token (lets an observer attach).
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// File refaults, then fresh anonymous memory, then a short sleep: the demo.
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

// ---- token markers (the engine ABI) ----------------------------------------

// Distinct bodies (a different tag each) keep the linker from folding the two
// markers into one address, which would fire both probes on each call. No
// atomics: x86 uprobes cannot sit on a `lock`-prefixed first instruction.

/// Marker: a token begins. Never inlined; the observer uprobes it by name.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn moe_engine_token_begin(index: u64, rec: *const TokenRecordV1) {
    std::hint::black_box((index, rec, 0xB_u8));
}

/// Marker: a token ended; `rec` is complete.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn moe_engine_token_end(index: u64, rec: *const TokenRecordV1) {
    std::hint::black_box((index, rec, 0xE_u8));
}

static mut NEXT_INDEX: u64 = 0;

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

#[derive(Debug, Clone, Copy)]
struct Usage {
    majflt: i64,
    minflt: i64,
    utime_ns: i64,
    stime_ns: i64,
    /// This thread's on-CPU time and run-queue wait, from the scheduler's
    /// own accounting (`/proc/thread-self/schedstat`).
    sched_cpu_ns: i64,
    sched_wait_ns: i64,
    /// Bytes this process caused to be read from storage (`/proc/self/io`).
    io_read_bytes: i64,
}

fn io_read_bytes() -> i64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("read_bytes:")?.trim().parse().ok()))
        .unwrap_or(0)
}

fn schedstat() -> (i64, i64) {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let mut it = s.split_whitespace().map(|v| v.parse::<i64>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// `getrusage` only (no /proc reads).
fn usage_fast() -> Usage {
    usage_with(false)
}

fn usage() -> Usage {
    usage_with(true)
}

fn usage_with(procfs: bool) -> Usage {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let ns = |t: libc::timeval| t.tv_sec * 1_000_000_000 + t.tv_usec * 1000;
    let (sched_cpu_ns, sched_wait_ns) = if procfs { schedstat() } else { (0, 0) };
    Usage {
        majflt: ru.ru_majflt,
        minflt: ru.ru_minflt,
        utime_ns: ns(ru.ru_utime),
        stime_ns: ns(ru.ru_stime),
        sched_cpu_ns,
        sched_wait_ns,
        io_read_bytes: if procfs { io_read_bytes() } else { 0 },
    }
}

/// What a phase measured about itself.
struct Measured {
    kind: &'static str,
    index: u64,
    pages: u64,
    wall_ns: u128,
    before: Usage,
    after: Usage,
    extra: Vec<(&'static str, u64)>,
}

impl Measured {
    fn json(&self) -> String {
        let mut s = format!(
            "{{\"kind\":\"{}\",\"index\":{},\"pages\":{},\"wall_ns\":{},\"majflt\":{},\"minflt\":{},\"utime_ns\":{},\"stime_ns\":{},\"sched_cpu_ns\":{},\"sched_wait_ns\":{},\"io_read_bytes\":{}",
            self.kind,
            self.index,
            self.pages,
            self.wall_ns,
            self.after.majflt - self.before.majflt,
            self.after.minflt - self.before.minflt,
            self.after.utime_ns - self.before.utime_ns,
            self.after.stime_ns - self.before.stime_ns,
            self.after.sched_cpu_ns - self.before.sched_cpu_ns,
            self.after.sched_wait_ns - self.before.sched_wait_ns,
            self.after.io_read_bytes - self.before.io_read_bytes,
        );
        for (k, v) in &self.extra {
            s.push_str(&format!(",\"{k}\":{v}"));
        }
        s.push('}');
        s
    }
}

/// Every phase runs inside this exported function, so that it can also be
/// observed as a call (`observer run --token-symbol workload_phase`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn workload_phase(ctx: *mut std::ffi::c_void) {
    // SAFETY: `ctx` is the `&mut dyn FnMut()` passed by `in_phase` below.
    let f = unsafe { &mut *ctx.cast::<&mut dyn FnMut()>() };
    f();
}

fn in_phase(mut f: impl FnMut()) {
    let mut dynf: &mut dyn FnMut() = &mut f;
    workload_phase((&raw mut dynf).cast());
}

/// Run `f` as one marked token and measure it.
fn token(kind: &'static str, pages: u64, f: impl FnOnce() -> Result<Vec<(&'static str, u64)>>) -> Result<Measured> {
    token_rec(kind, pages, false, f)
}

/// [`token`]; with `residual_compute`, the record's `compute_ns` is the wall
/// time (the engine ABI's residual when nothing else is timed).
fn token_rec(
    kind: &'static str,
    pages: u64,
    residual_compute: bool,
    f: impl FnOnce() -> Result<Vec<(&'static str, u64)>>,
) -> Result<Measured> {
    // SAFETY: single-threaded use of the token counter (phases run one by one).
    let index = unsafe {
        let i = NEXT_INDEX;
        NEXT_INDEX += 1;
        i
    };
    let mut rec = TokenRecordV1::empty();
    rec.index = index;
    // The workload's own numbers bracket the token's markers tightly: nothing
    // but a clock read between a measurement and a marker (reading /proc here
    // would leave a syscall, a likely preemption point, outside the window).
    let before = usage();
    let t0 = Instant::now();
    moe_engine_token_begin(index, &rec);
    let mut f = Some(f);
    let mut out = None;
    in_phase(|| out = f.take().map(|f| f()));
    let inner = usage_fast();
    rec.wall_ns = t0.elapsed().as_nanos() as u64;
    rec.majflt = (inner.majflt - before.majflt) as u64;
    rec.cpu_ns = (inner.utime_ns + inner.stime_ns - before.utime_ns - before.stime_ns) as u64;
    if residual_compute {
        rec.compute_ns = rec.wall_ns;
    }
    moe_engine_token_end(index, &rec);
    let wall_ns = t0.elapsed().as_nanos();
    let after = usage();
    let extra = out.expect("the phase ran")?;
    Ok(Measured { kind, index, pages, wall_ns, before, after, extra })
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

fn anon_map(len: usize) -> Result<Mapping> {
    let m = mmap(len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1)?;
    // SAFETY: the range is our mapping.
    unsafe { libc::madvise(m.ptr.cast(), len, libc::MADV_NOHUGEPAGE) };
    Ok(m)
}

fn write_file(path: &std::path::Path, size: u64) -> Result<()> {
    let mut f = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut chunk = vec![0u8; 1 << 20];
    for (i, b) in chunk.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).with_context(|| format!("writing {}", path.display()))?;
        left -= n as u64;
    }
    f.sync_all().context("fsync")
}

fn evict(f: &std::fs::File) -> Result<()> {
    // SAFETY: valid fd.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise(DONTNEED) failed: {}", std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

fn file_refault(path: &std::path::Path, size: u64, keep: bool) -> Result<Measured> {
    let ps = page_size();
    write_file(path, size)?;
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    evict(&f)?;
    let len = size as usize;
    let m = mmap(len, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd())?;
    // No readahead: every page is its own major fault.
    // SAFETY: the range is our mapping.
    unsafe { libc::madvise(m.ptr.cast(), len, libc::MADV_RANDOM) };
    let r = token("file-refault", (len / ps) as u64, || {
        let mut sum = 0u64;
        let mut off = 0;
        while off < len {
            // SAFETY: off < len, inside the mapping.
            sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(m.ptr.add(off)) } as u64);
            off += ps;
        }
        std::hint::black_box(sum);
        Ok(Vec::new())
    });
    drop(m);
    if !keep {
        let _ = std::fs::remove_file(path);
    }
    r
}

fn anon(size: u64, threads: usize, repeat: u32, delay_ms: u64) -> Result<Measured> {
    let ps = page_size();
    let len = size as usize;
    let threads = threads.max(1);
    std::thread::sleep(std::time::Duration::from_millis(delay_ms));
    token("anon", (len / ps) as u64 * repeat as u64, || {
        for _ in 0..repeat {
            let m = anon_map(len)?;
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
        }
        Ok(Vec::new())
    })
}

fn spin(ms: u64) {
    let t0 = Instant::now();
    let mut x = 0u64;
    while t0.elapsed().as_millis() < ms as u128 {
        for i in 0..10_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
        }
    }
    std::hint::black_box(x);
}

fn busy(ms: u64) -> Result<Measured> {
    token("busy", 0, || {
        spin(ms);
        Ok(Vec::new())
    })
}

fn tokens(
    n: u64,
    ms: u64,
    anon: u64,
    path: Option<&std::path::Path>,
    file_pages: u64,
    delay_ms: u64,
) -> Result<Vec<Measured>> {
    let ps = page_size();
    let file = match path {
        Some(p) => {
            let len = (n * file_pages).max(1) as usize * ps;
            write_file(p, len as u64)?;
            let f = std::fs::File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
            evict(&f)?;
            let m = mmap(len, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd())?;
            // SAFETY: the range is our mapping.
            unsafe { libc::madvise(m.ptr.cast(), len, libc::MADV_RANDOM) };
            Some(m)
        }
        None => None,
    };
    std::thread::sleep(std::time::Duration::from_millis(delay_ms));
    let mut out = Vec::new();
    for i in 0..n {
        out.push(token_rec("tokens", file_pages, true, || {
            spin(ms);
            if anon > 0 {
                let m = anon_map(anon as usize)?;
                for off in (0..anon as usize).step_by(ps) {
                    // SAFETY: inside the writable mapping.
                    unsafe { std::ptr::write_volatile(m.ptr.add(off), 1) };
                }
            }
            if let Some(m) = &file {
                let first = (i * file_pages) as usize;
                let mut sum = 0u64;
                for p in first..first + file_pages as usize {
                    // SAFETY: p < n * file_pages pages, inside the mapping.
                    sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(m.ptr.add(p * ps)) } as u64);
                }
                std::hint::black_box(sum);
            }
            Ok(Vec::new())
        })?);
    }
    if let Some(p) = path {
        let _ = std::fs::remove_file(p);
    }
    Ok(out)
}

fn sleep(ms: u64) -> Result<Measured> {
    token("sleep", 0, || {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        Ok(Vec::new())
    })
}

#[repr(C, align(4096))]
struct Block([u8; 4096]);

fn pread_direct(path: &std::path::Path, size: u64, block: u64) -> Result<Measured> {
    write_file(path, size)?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("cannot open {} with O_DIRECT", path.display()))?;
    evict(&f)?;
    let bs = block as usize;
    let mut buf: Vec<Block> = (0..bs.div_ceil(4096)).map(|_| Block([0; 4096])).collect();
    let r = token("pread-direct", 0, || {
        let mut io_ns = 0u64;
        let mut reads = 0u64;
        let mut off = 0u64;
        while off + block <= size {
            let t = Instant::now();
            // SAFETY: `buf` is a 4096-aligned buffer of at least `bs` bytes.
            let n = unsafe { libc::pread(f.as_raw_fd(), buf.as_mut_ptr().cast(), bs, off as i64) };
            io_ns += t.elapsed().as_nanos() as u64;
            if n != bs as isize {
                bail!("short O_DIRECT read at {off}: {n} ({})", std::io::Error::last_os_error());
            }
            reads += 1;
            off += block;
        }
        Ok(vec![("io_ns", io_ns), ("reads", reads)])
    });
    let _ = std::fs::remove_file(path);
    r
}

fn vm_swap_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmSwap:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn swap(size: u64, balloon: u64, pageout: bool) -> Result<Measured> {
    let ps = page_size();
    let len = size as usize;
    let buf = anon_map(len)?;
    // Fill with data that compresses like real weights do (not all zeros,
    // which zram would store as same-filled pages without decompression).
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for p in 0..len / 8 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // SAFETY: p*8 < len, inside the writable mapping.
        unsafe { std::ptr::write_volatile((buf.ptr as *mut u64).add(p), x & 0x0f0f_0f0f_0f0f_0f0f) };
    }
    if balloon > 0 {
        let b = anon_map(balloon as usize)?;
        let mut off = 0;
        while off < balloon as usize {
            // SAFETY: inside the writable balloon mapping.
            unsafe { std::ptr::write_volatile(b.ptr.add(off), 1) };
            off += ps;
        }
        drop(b);
    }
    if pageout {
        // SAFETY: the range is our mapping.
        let rc = unsafe {
            libc::madvise(buf.ptr.cast(), len, 21 /* MADV_PAGEOUT */)
        };
        if rc != 0 {
            bail!("madvise(MADV_PAGEOUT): {}", std::io::Error::last_os_error());
        }
    }
    let swapped_kib = vm_swap_kib();
    token("swap", (len / ps) as u64, || {
        let mut sum = 0u64;
        let mut off = 0;
        while off < len {
            // SAFETY: inside the mapping.
            sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(buf.ptr.add(off)) } as u64);
            off += ps;
        }
        std::hint::black_box(sum);
        Ok(vec![("swapped_kib_before", swapped_kib), ("swapped_kib_after", vm_swap_kib())])
    })
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::FileRefault { path, size, keep } => file_refault(&path, size, keep).map(|m| vec![m]),
        Cmd::Anon { size, threads, repeat, delay_ms } => anon(size, threads, repeat, delay_ms).map(|m| vec![m]),
        Cmd::Busy { ms } => busy(ms).map(|m| vec![m]),
        Cmd::Sleep { ms } => sleep(ms).map(|m| vec![m]),
        Cmd::PreadDirect { path, size, block } => pread_direct(&path, size, block).map(|m| vec![m]),
        Cmd::Swap { size, balloon, pageout } => swap(size, balloon, pageout).map(|m| vec![m]),
        Cmd::Tokens { n, ms, anon, path, file_pages, delay_ms } => {
            tokens(n, ms, anon, path.as_deref(), file_pages, delay_ms)
        }
        Cmd::Demo { path, size } => {
            (|| Ok(vec![file_refault(&path, size, false)?, anon(size, 2, 1, 0)?, busy(200)?, sleep(200)?]))()
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
