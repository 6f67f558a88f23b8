//! The expert cache's reads: `O_DIRECT` `pread64` on a few I/O worker threads, and the futex the
//! decode thread waits on.
//!
//! # Spec
//! - The model file is opened a second time with `O_RDONLY | O_DIRECT` ([`DirectFile`]). A read
//!   ([`Job`]) covers one part of one expert (its slice of `ffn_gate_exps`, `ffn_up_exps` or
//!   `ffn_down_exps`) widened to [`ALIGN`]-byte boundaries (the *window*), and lands straight in
//!   the slot's memory at an [`ALIGN`]-aligned address: no bounce buffer, no copy.
//! - Workers take jobs from one FIFO queue (demand reads before prefetches) and call
//!   `pread64(fd, slot memory, window length, window offset)`, repeated on a short read until the
//!   part's bytes are in (EOF before that is an error). The bytes `pread64` returned are the
//!   step's `read_bytes`; the time inside `pread64` is `io` (summed over workers, so it overlaps
//!   compute and can exceed a step's wall time).
//! - The last part of a slot to complete publishes the slot as ready in the slot table under its
//!   seqlock ([`super::slots`]) and then wakes its waiters: `FUTEX_WAKE_PRIVATE` on the slot's
//!   `state` word, the same 4 bytes an observer reads in `moe_engine_expert_slots`. A decode
//!   thread that needs the expert waits with `FUTEX_WAIT_PRIVATE` on that word while it reads
//!   `STATE_LOADING`, timed as `stall`.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

/// Alignment of `O_DIRECT` offsets, lengths and buffers (a page: at least any logical block).
pub const ALIGN: usize = 4096;

/// The model file opened for direct reads.
#[derive(Debug)]
pub struct DirectFile {
    pub file: File,
    pub len: u64,
}

impl DirectFile {
    pub fn open(path: &Path) -> std::io::Result<DirectFile> {
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)?;
        let len = file.metadata()?.len();
        Ok(DirectFile { file, len })
    }
}

/// One read: `len` bytes of the file from `offset` into `dst` (all [`ALIGN`]ed), of which the
/// first `need` must arrive.
#[derive(Debug, Clone, Copy)]
pub struct Job {
    pub slot: u32,
    pub offset: u64,
    pub len: usize,
    pub need: usize,
    pub dst: *mut u8,
}

// SAFETY: `dst` points into the cache's slot memory, which outlives the workers (they are joined
// before it is unmapped), and no one else touches a loading slot's bytes.
unsafe impl Send for Job {}

/// What the workers and the decode thread share.
pub struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Bytes returned by `pread64`, and ns spent inside it, over all workers.
    pub read_bytes: AtomicU64,
    pub io_ns: AtomicU64,
    pub reads: AtomicU64,
}

#[derive(Default)]
struct Queue {
    demand: VecDeque<Job>,
    prefetch: VecDeque<Job>,
    stop: bool,
}

/// Called by a worker when a job finished: `Ok(())`, or the error that ended it.
pub type Done = dyn Fn(&Job, std::io::Result<()>) + Send + Sync;

/// The I/O worker threads.
pub struct Workers {
    pub shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Workers({})", self.threads.len())
    }
}

impl Workers {
    /// Starts `n` workers reading from `file`; `done` is called after each job.
    pub fn start(n: usize, file: Arc<DirectFile>, done: Arc<Done>) -> std::io::Result<Workers> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            read_bytes: AtomicU64::new(0),
            io_ns: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        });
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let (s, f, d) = (Arc::clone(&shared), Arc::clone(&file), Arc::clone(&done));
            threads
                .push(std::thread::Builder::new().name(format!("engine-io-{i}")).spawn(move || worker(&s, &f, &*d))?);
        }
        Ok(Workers { shared, threads })
    }

    /// Queues `jobs` (demand reads go before every queued prefetch).
    pub fn submit(&self, jobs: impl IntoIterator<Item = Job>, prefetch: bool) {
        let mut q = self.shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let before = q.demand.len() + q.prefetch.len();
        if prefetch {
            q.prefetch.extend(jobs);
        } else {
            q.demand.extend(jobs);
        }
        let added = q.demand.len() + q.prefetch.len() - before;
        drop(q);
        for _ in 0..added.min(self.threads.len()) {
            self.shared.wake.notify_one();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shared.queue.lock().unwrap_or_else(PoisonError::into_inner).stop = true;
        self.shared.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn worker(s: &Shared, f: &DirectFile, done: &Done) {
    loop {
        let job = {
            let mut q = s.queue.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                if q.stop {
                    return;
                }
                if let Some(j) = q.demand.pop_front().or_else(|| q.prefetch.pop_front()) {
                    break j;
                }
                q = s.wake.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        let r = read_job(s, f, &job);
        done(&job, r);
    }
}

/// `pread64` until `job.need` bytes are in.
fn read_job(s: &Shared, f: &DirectFile, job: &Job) -> std::io::Result<()> {
    let fd = f.file.as_raw_fd();
    let mut got = 0usize;
    while got < job.need {
        let t = Instant::now();
        // SAFETY: `dst..dst+len` is slot memory reserved for this job (see `Job`); offsets and
        // lengths stay ALIGNed because a short direct read ends on a block boundary or at EOF.
        let n = unsafe {
            libc::pread64(fd, job.dst.add(got).cast(), job.len - got, (job.offset + got as u64) as libc::off64_t)
        };
        s.io_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        s.reads.fetch_add(1, Ordering::Relaxed);
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("end of file at {} before the expert's last byte", job.offset + got as u64),
            ));
        }
        s.read_bytes.fetch_add(n as u64, Ordering::Relaxed);
        got += n as usize;
    }
    Ok(())
}

/// Blocks while `word` holds `expected` (spurious returns are the caller's loop's business).
pub fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: a private futex wait on a live, aligned u32 of this process, without timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            std::ptr::null::<libc::timespec>(),
        )
    };
}

/// Wakes every thread waiting on `word`.
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: a private futex wake on a live, aligned u32 of this process.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX) };
}
