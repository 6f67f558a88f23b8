//! The expert cache (`--experts cache`): routed experts streamed from the file into a fixed pool
//! of slots in anonymous memory, instead of being served from the file mapping (page cache).
//!
//! # Spec
//! **Slots.** One anonymous mapping (`MADV_HUGEPAGE`; `mlock`ed with `--cache-lock`) cut into
//! `n_slots` slots of `slot_bytes` (a whole number of pages). A slot holds one expert of one layer:
//! its three parts (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` slices), each as the
//! [`io::ALIGN`]ed window of the file that covers it, at a fixed offset per part
//! ([`ExpertCache::part_offsets`]); the part's bytes are at `window offset + file offset % ALIGN`.
//! `n_slots = budget / slot_bytes`, at most every routed expert, at least `n_expert_used`.
//! The table of slots is published in `moe_engine_expert_slots` ([`slots`]).
//!
//! **Reads.** Filled by `O_DIRECT` `pread64` of the windows straight into the slot on I/O worker
//! threads ([`io`]): three reads per missing expert. Read bytes per expert = the windows
//! (≤ the expert's bytes + 3 × 2 × 4 KiB).
//!
//! **Overlap.** The MoE block asks for its experts as soon as the router has chosen them
//! ([`ExpertWeights::request`](crate::blocks::moe::ExpertWeights)): every missing expert's reads
//! are queued at once; the experts already in the cache are computed first, then the others in
//! batches as their reads complete (the decode thread waits on the first pending slot's futex;
//! the wait is `stall`).
//!
//! **Eviction.** A slot for a missing expert is taken from the slots that are neither pinned nor
//! loading: first an empty one, else the one whose expert has the smallest use count (ties: the
//! least recently used). Every `(layer, expert)` keeps a use count whether or not it is resident,
//! halved every [`AGE_EVERY`] tokens (popularity, not recency, predicts routing). Pinned: the
//! experts of the layer being computed (and the next layer's prefetched ones). So a cold expert
//! replaces the coldest resident one and is the next to go, and a cache smaller than one token's
//! working set keeps its hottest experts instead of cycling through all of them (LRU's collapse
//! to 0 % hits). When a layer needs more experts than there are unpinned slots (a long prompt
//! batch on a small cache), the rest are read into the slots of experts already computed.
//!
//! **Prefetch** (`--prefetch`, off by default): after routing layer `l` of a one-token step, the
//! router of the next MoE layer is applied to layer `l`'s normed input and its top-k experts that
//! are missing are read behind the demand reads (a separate, lower-priority queue), pinned until
//! that layer has run.
//!
//! **Counters** ([`CacheStats`], per step in the telemetry): `hits`/`misses` = requested experts
//! that were ready / not ready when their layer asked (a prefetched expert still loading is a
//! miss; hits + misses = experts used); `read_bytes` and `io_ns` from the workers' `pread64`
//! calls; `stall_ns` = the decode thread's futex waits; `mgmt_ns` = the decode thread's time in
//! the cache's bookkeeping (lookups, eviction, queueing, the prefetch router).

pub mod budget;
pub mod io;
pub mod slots;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use crate::blocks::moe::{ExpertView, ExpertWeights, Moe};
use crate::blocks::{Ctx, QRows, sized};
use crate::model::{Ffn, Model, ModelError};
use io::{ALIGN, DirectFile, Job, futex_wait, futex_wake};
use slots::{ExpertSlot, STATE_EMPTY, STATE_LOADING, STATE_READY, Table};

/// Tokens between two halvings of the use counts.
pub const AGE_EVERY: u64 = 256;

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Memory for the slots.
    pub bytes: u64,
    pub io_threads: usize,
    /// `mlock` the slots.
    pub lock: bool,
    pub prefetch: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{path}: the model has no routed experts to cache")]
    NoExperts { path: String },
    #[error(
        "{path}: a cache of {bytes} bytes holds {slots} expert slots of {slot_bytes} bytes; at least {need} \
         (the experts one token uses in one layer) are needed: give a larger --cache-mib"
    )]
    TooSmall { path: String, bytes: u64, slots: u64, slot_bytes: usize, need: usize },
    #[error("{path}: cannot open for O_DIRECT reads: {source} (the expert cache needs a file system with O_DIRECT)")]
    Open { path: String, source: std::io::Error },
    #[error("{path}: cannot allocate {bytes} bytes for the expert cache: {source}")]
    Alloc { path: String, bytes: usize, source: std::io::Error },
    #[error(
        "{path}: mlock of the {bytes}-byte expert cache failed: {source} (`--cache-lock` needs CAP_IPC_LOCK or \
         `ulimit -l` of at least that size, and room under the memory limit)"
    )]
    Mlock { path: String, bytes: usize, source: std::io::Error },
    #[error("starting the expert cache's I/O threads: {0}")]
    Threads(std::io::Error),
}

/// Cumulative counters (rules in the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub read_bytes: u64,
    /// `pread64` calls.
    pub reads: u64,
    pub io_ns: u64,
    pub stall_ns: u64,
    pub mgmt_ns: u64,
    /// Experts read by prefetch, and those of them a later layer used.
    pub prefetched: u64,
    pub prefetch_used: u64,
}

impl CacheStats {
    /// `self − before`, field by field.
    pub fn since(&self, before: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            read_bytes: self.read_bytes - before.read_bytes,
            reads: self.reads - before.reads,
            io_ns: self.io_ns - before.io_ns,
            stall_ns: self.stall_ns - before.stall_ns,
            mgmt_ns: self.mgmt_ns - before.mgmt_ns,
            prefetched: self.prefetched - before.prefetched,
            prefetch_used: self.prefetch_used - before.prefetch_used,
        }
    }

    /// `hits / (hits + misses)` in percent; `None` without requests.
    pub fn hit_pct(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 * 100.0 / n as f64)
    }
}

/// Where one part (gate, up or down) of a layer's experts is in the file.
#[derive(Debug, Clone, Copy)]
struct Part {
    /// The tensor's first byte and the bytes of one expert.
    base: u64,
    per: u64,
}

impl Part {
    fn range(&self, e: usize) -> (u64, u64) {
        let s = self.base + e as u64 * self.per;
        (s, s + self.per)
    }
}

/// The slots' memory: one anonymous mapping, unmapped on drop.
struct SlotMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned; who writes which slot when is the cache's protocol (module docs).
unsafe impl Send for SlotMemory {}
// SAFETY: as above.
unsafe impl Sync for SlotMemory {}

impl Drop for SlotMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping; the I/O workers are joined and the table unpublished before.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Per-slot facts the workers update.
struct SlotIo {
    parts_left: AtomicU32,
    failed: AtomicU32,
}

/// The decode thread's bookkeeping.
struct Inner {
    /// Incremented by every request (one per MoE layer per step).
    generation: u64,
    /// Per slot: pinned while `pin >= generation`.
    pin: Vec<u64>,
    /// Per slot: its `(layer, expert)` key, or NONE.
    owner: Vec<u32>,
    /// Per slot: the tick of its last use (LRU tie break), and whether a prefetch loaded it.
    last_tick: Vec<u64>,
    prefetched: Vec<bool>,
    /// Per key: the use count.
    count: Vec<u32>,
    tick: u64,
    tokens_since_aging: u64,
    /// The layer being computed, its experts waiting for reads (expert, slot), those without a
    /// slot yet, and the slots handed out in the last batch.
    layer: usize,
    pending: Vec<(usize, u32)>,
    deferred: Vec<usize>,
    returned: Vec<u32>,
    jobs: Vec<Job>,
    /// Prefetch router scratch.
    xr: QRows,
    logits: Vec<f32>,
    order: Vec<usize>,
}

/// The expert cache (module docs). Serves the MoE blocks as their [`ExpertWeights`].
pub struct ExpertCache {
    path: String,
    /// The model file's length (a window past its end reads up to it).
    file_len: u64,
    n_expert: usize,
    n_used: usize,
    /// Per layer: the three parts, for MoE layers.
    layers: Vec<Option<[Part; 3]>>,
    part_off: [usize; 3],
    slot_bytes: usize,
    n_slots: usize,
    /// Per `(layer, expert)` key: the slot holding it, or NONE (written by the decode thread only).
    slot_of: Vec<AtomicU32>,
    slot_io: Arc<Vec<SlotIo>>,
    first_error: Arc<Mutex<Option<String>>>,
    inner: Mutex<Inner>,
    step: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    stall_ns: AtomicU64,
    mgmt_ns: AtomicU64,
    prefetched: AtomicU64,
    prefetch_used: AtomicU64,
    /// `--cache-log`: a line per expert read started (see [`ExpertCache::set_load_log`]).
    load_log: Mutex<Option<std::fs::File>>,
    pub config: CacheConfig,
    // Drop order: the workers are joined in `drop`, then the table is unpublished, then the
    // memory is unmapped (fields drop in declaration order).
    workers: Option<io::Workers>,
    table: Arc<Table>,
    mem: SlotMemory,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertCache({} slots of {} bytes, {:?})", self.n_slots, self.slot_bytes, self.config)
    }
}

impl Drop for ExpertCache {
    fn drop(&mut self) {
        drop(self.workers.take());
    }
}

fn align_up(x: u64) -> u64 {
    x.next_multiple_of(ALIGN as u64)
}

impl ExpertCache {
    /// A cache of `cfg.bytes` for `model`'s routed experts, its slots published for observers.
    pub fn new(model: &Model, cfg: CacheConfig) -> Result<ExpertCache, CacheError> {
        let path = model.gguf.path().display().to_string();
        let c = &model.cfg;
        let layers: Vec<Option<[Part; 3]>> = model
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Moe(w) => Some([&w.gate_exps, &w.up_exps, &w.down_exps].map(|x| {
                    let r = x.expert_range(0);
                    Part { base: r.start as u64, per: r.len() as u64 }
                })),
                _ => None,
            })
            .collect();
        let n_moe = layers.iter().flatten().count();
        if n_moe == 0 {
            return Err(CacheError::NoExperts { path });
        }
        // The window of a part is at most its bytes rounded up, plus one block for a start
        // inside a block.
        let mut win = [0u64; 3];
        for parts in layers.iter().flatten() {
            for (w, p) in win.iter_mut().zip(parts) {
                *w = (*w).max(align_up(p.per) + ALIGN as u64);
            }
        }
        let part_off = [0, win[0] as usize, (win[0] + win[1]) as usize];
        let page = crate::placement::page_size() as u64;
        let slot_bytes = (win.iter().sum::<u64>()).next_multiple_of(page) as usize;
        let total = (n_moe * c.n_expert) as u64;
        let n_slots = (cfg.bytes / slot_bytes as u64).min(total);
        if n_slots < c.n_expert_used as u64 {
            return Err(CacheError::TooSmall {
                path,
                bytes: cfg.bytes,
                slots: n_slots,
                slot_bytes,
                need: c.n_expert_used,
            });
        }
        let n_slots = n_slots as usize;
        let file = Arc::new(
            DirectFile::open(model.gguf.path()).map_err(|source| CacheError::Open { path: path.clone(), source })?,
        );
        let file_len = file.len;
        let len = n_slots * slot_bytes;
        // SAFETY: a fresh private anonymous mapping chosen by the kernel.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CacheError::Alloc { path, bytes: len, source: std::io::Error::last_os_error() });
        }
        let mem = SlotMemory { ptr: p.cast(), len };
        // SAFETY: advice on our own mapping (best effort: fewer TLB misses in the expert kernels).
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        // SAFETY: our own mapping.
        if cfg.lock && unsafe { libc::mlock(p, len) } != 0 {
            return Err(CacheError::Mlock { path, bytes: len, source: std::io::Error::last_os_error() });
        }
        let table = Arc::new(Table::publish(
            (0..n_slots)
                .map(|i| ExpertSlot::new(mem.ptr as u64 + (i * slot_bytes) as u64, slot_bytes as u64))
                .collect(),
        ));
        let slot_io: Arc<Vec<SlotIo>> = Arc::new(
            (0..n_slots).map(|_| SlotIo { parts_left: AtomicU32::new(0), failed: AtomicU32::new(0) }).collect(),
        );
        let first_error = Arc::new(Mutex::new(None));
        let done: Arc<io::Done> = {
            let (table, slot_io, first_error, path) =
                (Arc::clone(&table), Arc::clone(&slot_io), Arc::clone(&first_error), path.clone());
            Arc::new(move |job: &Job, r: std::io::Result<()>| {
                let s = &slot_io[job.slot as usize];
                if let Err(e) = r {
                    s.failed.store(1, Ordering::SeqCst);
                    first_error.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert_with(|| {
                        format!("{path}: O_DIRECT read of {} bytes at offset {}: {e}", job.len, job.offset)
                    });
                }
                if s.parts_left.fetch_sub(1, Ordering::AcqRel) == 1 {
                    let st = if s.failed.load(Ordering::SeqCst) != 0 { STATE_EMPTY } else { STATE_READY };
                    let word = &table.slots[job.slot as usize].state;
                    table.update(|_| word.store(st, Ordering::SeqCst));
                    futex_wake(word);
                }
            })
        };
        let workers = io::Workers::start(cfg.io_threads, file, done).map_err(CacheError::Threads)?;
        let n_keys = layers.len() * c.n_expert;
        Ok(ExpertCache {
            path,
            file_len,
            n_expert: c.n_expert,
            n_used: c.n_expert_used,
            layers,
            part_off,
            slot_bytes,
            n_slots,
            slot_of: (0..n_keys).map(|_| AtomicU32::new(NONE)).collect(),
            slot_io,
            first_error,
            inner: Mutex::new(Inner {
                generation: 0,
                pin: vec![0; n_slots],
                owner: vec![NONE; n_slots],
                last_tick: vec![0; n_slots],
                prefetched: vec![false; n_slots],
                count: vec![0; n_keys],
                tick: 0,
                tokens_since_aging: 0,
                layer: 0,
                pending: Vec::new(),
                deferred: Vec::new(),
                returned: Vec::new(),
                jobs: Vec::new(),
                xr: QRows::default(),
                logits: Vec::new(),
                order: Vec::new(),
            }),
            step: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            stall_ns: AtomicU64::new(0),
            mgmt_ns: AtomicU64::new(0),
            prefetched: AtomicU64::new(0),
            prefetch_used: AtomicU64::new(0),
            load_log: Mutex::new(None),
            config: cfg,
            workers: Some(workers),
            table,
            mem,
        })
    }

    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes of the slots' memory.
    pub fn bytes(&self) -> usize {
        self.mem.len
    }

    /// Bytes of one expert (its three parts) in the first MoE layer.
    pub fn expert_bytes(&self) -> u64 {
        self.layers.iter().flatten().next().map_or(0, |p| p.iter().map(|x| x.per).sum())
    }

    /// Where the gate, up and down windows start inside a slot.
    pub fn part_offsets(&self) -> [usize; 3] {
        self.part_off
    }

    /// The slot table as published (also when no header is exported).
    pub fn table(&self) -> &'static [ExpertSlot] {
        self.table.slots
    }

    /// Whether the table is the one in the exported `moe_engine_expert_slots`.
    pub fn is_published(&self) -> bool {
        self.table.is_published()
    }

    /// The file ranges of expert `e` of layer `il` (gate, up, down); `None` for a layer without
    /// routed experts.
    pub fn expert_file_ranges(&self, il: usize, e: usize) -> Option<[(u64, u64); 3]> {
        Some(self.layers.get(il)?.as_ref()?.map(|p| p.range(e)))
    }

    /// The step (marker index) now starting: `last_use` of the slots it uses.
    pub fn begin_step(&self, index: u64) {
        self.step.store(index, Ordering::Relaxed);
        let mut g = self.lock();
        g.tokens_since_aging += 1;
        if g.tokens_since_aging >= AGE_EVERY {
            g.tokens_since_aging = 0;
            g.count.iter_mut().for_each(|c| *c /= 2);
        }
    }

    pub fn stats(&self) -> CacheStats {
        let w = &self.workers.as_ref().expect("workers live while the cache does").shared;
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            read_bytes: w.read_bytes.load(Ordering::Relaxed),
            reads: w.reads.load(Ordering::Relaxed),
            io_ns: w.io_ns.load(Ordering::Relaxed),
            stall_ns: self.stall_ns.load(Ordering::Relaxed),
            mgmt_ns: self.mgmt_ns.load(Ordering::Relaxed),
            prefetched: self.prefetched.load(Ordering::Relaxed),
            prefetch_used: self.prefetch_used.load(Ordering::Relaxed),
        }
    }

    /// Resident experts now (ready slots).
    pub fn resident(&self) -> usize {
        self.table.slots.iter().filter(|s| s.state.load(Ordering::Relaxed) == STATE_READY).count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn workers(&self) -> &io::Workers {
        self.workers.as_ref().expect("workers live while the cache does")
    }

    /// A slot for a new expert: an empty one, else the unpinned, not loading one with the smallest
    /// use count, then the least recently used. `floor`: slots with `pin >= floor` are pinned.
    fn victim(&self, g: &Inner, floor: u64) -> Option<usize> {
        let mut best: Option<(u32, u64, usize)> = None;
        for s in 0..self.n_slots {
            if g.pin[s] >= floor || self.slot_io[s].parts_left.load(Ordering::Acquire) != 0 {
                continue;
            }
            if g.owner[s] == NONE {
                return Some(s);
            }
            let k = (g.count[g.owner[s] as usize], g.last_tick[s], s);
            if best.is_none_or(|b| (k.0, k.1) < (b.0, b.1)) {
                best = Some(k);
            }
        }
        best.map(|b| b.2)
    }

    /// Takes a slot for expert `e` of layer `il`, pins it until `pin` and queues its reads into
    /// `g.jobs`; `None` when every slot is pinned or loading.
    fn assign(&self, g: &mut Inner, il: usize, e: usize, pin: u64, prefetch: bool) -> Option<u32> {
        let s = self.victim(g, g.generation)?;
        let key = il * self.n_expert + e;
        if g.owner[s] != NONE {
            self.slot_of[g.owner[s] as usize].store(NONE, Ordering::Relaxed);
        }
        g.owner[s] = key as u32;
        g.pin[s] = pin;
        g.last_tick[s] = g.tick;
        g.prefetched[s] = prefetch;
        self.slot_of[key].store(s as u32, Ordering::Relaxed);
        let io = &self.slot_io[s];
        io.failed.store(0, Ordering::SeqCst);
        io.parts_left.store(3, Ordering::SeqCst);
        let slot = &self.table.slots[s];
        self.table.update(|_| {
            slot.layer.store(il as u32, Ordering::SeqCst);
            slot.expert.store(e as u32, Ordering::SeqCst);
            slot.state.store(STATE_LOADING, Ordering::SeqCst);
        });
        slot.last_use.store(self.step.load(Ordering::Relaxed), Ordering::Relaxed);
        let parts = self.layers[il].as_ref().expect("a MoE layer");
        // The bytes the windows' reads return when they succeed (up to the end of the file).
        let mut bytes = 0u64;
        for (p, off) in parts.iter().zip(self.part_off) {
            let (start, end) = p.range(e);
            let a = start / ALIGN as u64 * ALIGN as u64;
            let len = (align_up(end) - a) as usize;
            bytes += (a + len as u64).min(self.file_len).saturating_sub(a);
            g.jobs.push(Job {
                slot: s as u32,
                offset: a,
                len,
                need: (end - a) as usize,
                // SAFETY: inside slot s (the window fits its part's room, see `new`).
                dst: unsafe { self.mem.ptr.add(s * self.slot_bytes + off) },
            });
        }
        if let Some(f) = self.load_log.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
            use std::io::Write;
            // One write per line (a reader never sees half of one); best effort: a full disk loses
            // log lines, never the step.
            let line = format!("{} {il} {e} {bytes}\n", self.step.load(Ordering::Relaxed));
            _ = f.write_all(line.as_bytes());
        }
        Some(s as u32)
    }

    /// Log every expert read started from now on to `f`: one line `STEP LAYER EXPERT BYTES` (STEP:
    /// the index of [`Self::begin_step`], the token markers' index; BYTES: what the expert's
    /// reads return, its three windows up to the end of the file), written unbuffered (one
    /// `write` per line) when its reads are queued.
    pub fn set_load_log(&self, f: std::fs::File) {
        *self.load_log.lock().unwrap_or_else(PoisonError::into_inner) = Some(f);
    }

    fn submit(&self, g: &mut Inner, prefetch: bool) {
        if !g.jobs.is_empty() {
            self.workers().submit(g.jobs.drain(..), prefetch);
        }
    }

    fn read_error(&self, il: usize, e: usize) -> ModelError {
        let why = self.first_error.lock().unwrap_or_else(PoisonError::into_inner).clone();
        ModelError::Bad {
            path: self.path.clone(),
            what: format!(
                "reading expert {e} of layer {il} into the expert cache failed: {}",
                why.unwrap_or_else(|| "unknown error".into())
            ),
        }
    }

    /// Prefetch for the MoE layer after `il` (module docs), into `g.jobs`.
    fn prefetch_next(&self, ctx: &Ctx<'_>, il: usize, xn: &[f32], g: &mut Inner) -> Result<(), ModelError> {
        let Some(next) = ctx.model.layers.get(il + 1) else { return Ok(()) };
        let Ffn::Moe(w) = &next.ffn else { return Ok(()) };
        let d = ctx.cfg().n_embd;
        let x = &xn[(ctx.n - 1) * d..ctx.n * d];
        let Inner { xr, logits, order, .. } = g;
        let logits = sized(logits, self.n_expert);
        ctx.matmul(&w.router, xr.quantize(w.router.ty, x, d)?, logits);
        order.clear();
        order.extend(0..self.n_expert);
        let desc = |&a: &usize, &b: &usize| logits[b].total_cmp(&logits[a]).then(a.cmp(&b));
        if self.n_used < self.n_expert {
            order.select_nth_unstable_by(self.n_used, desc);
        }
        let top: Vec<usize> = order[..self.n_used].to_vec();
        let pin = g.generation + 1;
        for e in top {
            let key = (il + 1) * self.n_expert + e;
            match self.slot_of[key].load(Ordering::Relaxed) {
                NONE => {
                    if self.assign(g, il + 1, e, pin, true).is_some() {
                        self.prefetched.fetch_add(1, Ordering::Relaxed);
                    }
                }
                s => g.pin[s as usize] = g.pin[s as usize].max(pin),
            }
        }
        self.submit(g, true);
        Ok(())
    }

    /// Waits until slot `s` is no longer loading (the stall); an error if its read failed.
    fn wait_slot(&self, s: u32, il: usize, e: usize) -> Result<(), ModelError> {
        let word = &self.table.slots[s as usize].state;
        if word.load(Ordering::Acquire) == STATE_LOADING {
            let t = Instant::now();
            while word.load(Ordering::Acquire) == STATE_LOADING {
                futex_wait(word, STATE_LOADING);
            }
            self.stall_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        if word.load(Ordering::Acquire) != STATE_READY {
            return Err(self.read_error(il, e));
        }
        Ok(())
    }
}

impl ExpertWeights for ExpertCache {
    fn expert_weights(&self, layer: usize, w: &Moe, e: usize) -> ExpertView<'_> {
        let s = self.slot_of[layer * self.n_expert + e].load(Ordering::Relaxed);
        assert!(
            s != NONE && self.table.slots[s as usize].state.load(Ordering::Acquire) == STATE_READY,
            "expert {e} of layer {layer} was used before the cache had it (the MoE block must compute only \
             the experts `request`/`wait_ready` returned)"
        );
        let base = s as usize * self.slot_bytes;
        let part = |x: &crate::blocks::ExpertWeight, i: usize| {
            let r = x.expert_range(e);
            let off = base + self.part_off[i] + r.start % ALIGN;
            assert!(off + r.len() <= base + self.slot_bytes, "expert {e} of layer {layer} does not fit its slot");
            // SAFETY: inside slot s, which is ready (its reads completed before the Acquire load
            // above) and pinned while the layer runs, so no read writes it meanwhile.
            unsafe { std::slice::from_raw_parts(self.mem.ptr.add(off), r.len()) }
        };
        ExpertView { gate: part(&w.gate_exps, 0), up: part(&w.up_exps, 1), down: part(&w.down_exps, 2) }
    }

    fn request(
        &self,
        ctx: &Ctx<'_>,
        layer: usize,
        experts: &[usize],
        xn: &[f32],
        ready: &mut Vec<usize>,
    ) -> Result<(), ModelError> {
        let t = Instant::now();
        let mut g = self.lock();
        let g = &mut *g;
        g.generation += 1;
        g.tick += 1;
        g.layer = layer;
        g.pending.clear();
        g.deferred.clear();
        g.returned.clear();
        let step = self.step.load(Ordering::Relaxed);
        let (mut hits, mut misses) = (0u64, 0u64);
        let mut need = Vec::new();
        for &e in experts {
            let key = layer * self.n_expert + e;
            g.count[key] = g.count[key].saturating_add(1);
            match self.slot_of[key].load(Ordering::Relaxed) {
                NONE => {
                    misses += 1;
                    need.push(e);
                }
                s => {
                    let su = s as usize;
                    g.pin[su] = g.generation;
                    g.last_tick[su] = g.tick;
                    if std::mem::take(&mut g.prefetched[su]) {
                        self.prefetch_used.fetch_add(1, Ordering::Relaxed);
                    }
                    self.table.slots[su].last_use.store(step, Ordering::Relaxed);
                    match self.table.slots[su].state.load(Ordering::Acquire) {
                        STATE_READY => {
                            hits += 1;
                            ready.push(e);
                            g.returned.push(s);
                        }
                        STATE_LOADING => {
                            misses += 1;
                            g.pending.push((e, s));
                        }
                        _ => {
                            // A failed read left the slot empty: report it.
                            return Err(self.read_error(layer, e));
                        }
                    }
                }
            }
        }
        for e in need {
            match self.assign(g, layer, e, g.generation, false) {
                Some(s) => g.pending.push((e, s)),
                None => g.deferred.push(e),
            }
        }
        self.submit(g, false);
        self.hits.fetch_add(hits, Ordering::Relaxed);
        self.misses.fetch_add(misses, Ordering::Relaxed);
        let r = if self.config.prefetch && ctx.n == 1 { self.prefetch_next(ctx, layer, xn, g) } else { Ok(()) };
        self.mgmt_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    fn wait_ready(&self, layer: usize, ready: &mut Vec<usize>) -> Result<(), ModelError> {
        let t = Instant::now();
        let mut g = self.lock();
        let g = &mut *g;
        debug_assert_eq!(g.layer, layer);
        if !g.deferred.is_empty() {
            // The experts computed so far in this layer are done: their slots take the rest.
            for s in std::mem::take(&mut g.returned) {
                g.pin[s as usize] = 0;
            }
            let deferred = std::mem::take(&mut g.deferred);
            for e in deferred {
                match self.assign(g, layer, e, g.generation, false) {
                    Some(s) => g.pending.push((e, s)),
                    None => g.deferred.push(e),
                }
            }
            self.submit(g, false);
        }
        g.returned.clear();
        let mgmt = t.elapsed();
        let Some(&(e, s)) = g.pending.first() else {
            self.mgmt_ns.fetch_add(mgmt.as_nanos() as u64, Ordering::Relaxed);
            return if g.deferred.is_empty() {
                Ok(())
            } else {
                Err(ModelError::Bad {
                    path: self.path.clone(),
                    what: format!("layer {layer}: no expert slot can be freed ({} slots)", self.n_slots),
                })
            };
        };
        self.wait_slot(s, layer, e)?;
        let t = Instant::now();
        let mut i = 0;
        while i < g.pending.len() {
            let (e, s) = g.pending[i];
            match self.table.slots[s as usize].state.load(Ordering::Acquire) {
                STATE_LOADING => i += 1,
                STATE_READY => {
                    ready.push(e);
                    g.returned.push(s);
                    g.pending.remove(i);
                }
                _ => return Err(self.read_error(layer, e)),
            }
        }
        self.mgmt_ns.fetch_add((mgmt + t.elapsed()).as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }
}
