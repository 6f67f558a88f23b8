//! A small fork-join thread pool for the decode loop.
//!
//! Decode issues a few dozen short parallel regions per layer (a matrix-vector product, a set
//! of experts), each lasting tens of microseconds, so spawning threads or going through a
//! general work-stealing scheduler per region costs as much as the work. Like ggml's CPU
//! threadpool, workers spin briefly on a generation counter between regions and park after
//! a while idle; the calling thread takes part in every region.
//!
//! A region waits only for the workers that joined it. A worker joins while the region is open
//! (one atomic word holds the generation, the open flag and the count of workers inside); the
//! caller closes it once every task has been claimed, and waits for the workers inside. A worker
//! that was not running when the region opened (preempted on a busy machine, or parked) is not
//! waited for: waiting for its acknowledgement cost a scheduler time slice per region, and took
//! the tiny model's decode from about 3500 to about 40 tok/s beside three busy loops on 2 cores.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};

/// Iterations a worker spins on the generation counter before parking.
const SPIN_LIMIT: u32 = 1 << 16;

/// `Shared::region`: the generation (bits 16 and up), whether workers may still join (`OPEN`),
/// and the workers inside (`INSIDE`, the low 15 bits).
const GEN_SHIFT: u32 = 16;
const OPEN: u64 = 1 << 15;
const INSIDE: u64 = OPEN - 1;

type Job = dyn Fn(usize) + Sync;

struct Shared {
    region: AtomicU64,
    /// Lifetime-erased pointer to the current job; valid while a region is running.
    job: Mutex<Option<JobPtr>>,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    stop: AtomicBool,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync`, and `Pool::run` keeps it alive until every worker has
// finished with it (it waits for `workers_done`).
unsafe impl Send for JobPtr {}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pool({} threads)", self.threads())
    }
}

impl Pool {
    /// A pool running regions on `threads` threads in total (the caller plus `threads - 1`
    /// workers).
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            region: AtomicU64::new(0),
            job: Mutex::new(None),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let s = Arc::clone(&shared);
                let h = thread::Builder::new()
                    .name(format!("engine-worker-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawning an engine worker thread");
                let t = h.thread().clone();
                (h, t)
            })
            .collect();
        Pool { shared, workers }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for every `i in 0..n_tasks`, spread over the pool; returns when all are done.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        let s = &*self.shared;
        // SAFETY: erasing the lifetime is sound because this function does not return before
        // the region is closed and every worker that joined it has left, after its last use of
        // the pointer; no worker joins a closed region, and the next region replaces it.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        // Nobody is inside (the last region was left empty): a new generation, open.
        let generation = (s.region.load(Ordering::Relaxed) >> GEN_SHIFT) + 1;
        s.region.store(generation << GEN_SHIFT | OPEN, Ordering::Release);
        for (_, t) in &self.workers {
            t.unpark();
        }
        drain(s, f);
        // Every task is claimed: close, and wait for the workers inside.
        s.region.fetch_and(!OPEN, Ordering::AcqRel);
        let mut spins = 0u32;
        while s.region.load(Ordering::Acquire) & INSIDE != 0 {
            spins += 1;
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

fn drain(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.n_tasks.load(Ordering::Relaxed);
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        // Join the next open region (module doc); one that closed before this worker saw it is
        // skipped.
        loop {
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            let r = s.region.load(Ordering::Acquire);
            let generation = r >> GEN_SHIFT;
            if generation != seen {
                if r & OPEN == 0 {
                    seen = generation;
                } else if s.region.compare_exchange(r, r + 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    seen = generation;
                    break;
                } else {
                    continue; // another worker joined, or the region closed: look again
                }
            }
            spins += 1;
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
            } else {
                thread::park();
            }
        }
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(p)) = job {
            // SAFETY: see `Pool::run`: the job outlives this use.
            drain(s, unsafe { &*p });
        }
        s.region.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.region.fetch_add(1 << GEN_SHIFT, Ordering::Release);
        for (h, t) in self.workers.drain(..) {
            t.unpark();
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_regions() {
        let pool = Pool::new(3);
        for n in [1usize, 2, 7, 100] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
            }
        }
    }

    /// Workers that share one CPU with the caller are mostly not running when a region opens:
    /// they miss regions, join late or join closed ones. Every task still runs once, and no
    /// region is left with a worker inside.
    #[test]
    fn every_task_runs_once_when_workers_share_one_cpu_with_the_caller() {
        // SAFETY: plain syscalls on this thread's own affinity (a test thread of its own; the
        // workers inherit it when spawned).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(0, &mut set);
            assert_eq!(libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set), 0);
        }
        let pool = Pool::new(4);
        let by_caller = AtomicUsize::new(0);
        let me = thread::current().id();
        for round in 0..3000usize {
            let n = 1 + round % 9;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                if thread::current().id() == me {
                    by_caller.fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
            assert_eq!(pool.shared.region.load(Ordering::Relaxed) & (OPEN | INSIDE), 0, "round {round}");
        }
        eprintln!("the caller ran {} of the tasks", by_caller.load(Ordering::Relaxed));
    }
}
