//! A small fork-join thread pool for the decode loop.
//!
//! Decode issues a few dozen short parallel regions per layer (a matrix-vector product, a set
//! of experts), each lasting tens of microseconds, so spawning threads or going through a
//! general work-stealing scheduler per region costs as much as the work. Like ggml's CPU
//! threadpool, workers spin briefly on a generation counter between regions and park after
//! a while idle; the calling thread takes part in every region.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};

/// Iterations a worker spins on the generation counter before parking.
const SPIN_LIMIT: u32 = 1 << 16;

type Job = dyn Fn(usize) + Sync;

struct Shared {
    generation: AtomicU64,
    /// Lifetime-erased pointer to the current job; valid while a region is running.
    job: Mutex<Option<JobPtr>>,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    workers_done: AtomicUsize,
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
            generation: AtomicU64::new(0),
            job: Mutex::new(None),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            workers_done: AtomicUsize::new(0),
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
        // every worker has incremented `workers_done` for this generation, after its last use
        // of the pointer; the next region replaces it.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        s.n_tasks.store(n_tasks, Ordering::Relaxed);
        s.next.store(0, Ordering::Relaxed);
        s.workers_done.store(0, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        for (_, t) in &self.workers {
            t.unpark();
        }
        drain(s, f);
        let mut spins = 0u32;
        while s.workers_done.load(Ordering::Acquire) < self.workers.len() {
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
        let generation = loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                break g;
            }
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            spins += 1;
            if spins < SPIN_LIMIT {
                std::hint::spin_loop();
            } else {
                thread::park();
            }
        };
        seen = generation;
        if s.stop.load(Ordering::Relaxed) {
            return;
        }
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(p)) = job {
            // SAFETY: see `Pool::run`: the job outlives this use.
            drain(s, unsafe { &*p });
        }
        s.workers_done.fetch_add(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.shared.generation.fetch_add(1, Ordering::Release);
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
}
