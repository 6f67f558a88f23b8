//! Per-step telemetry and the `bmoe_metrics v1` writer.
//!
//! ## Measurement rules
//! [`Meter::step`] wraps one step (the prompt, or one generated token) between the token markers:
//!
//! ```text
//! t0 → getrusage → moe_engine_token_begin(index, &rec)
//!   → work (forward pass, sampling, output of the token) → tm → previous step's metrics row
//!   → memory facts → getrusage → t_end
//! moe_engine_token_end(index, &rec)        (rec complete)
//! t0 of the next step (when the end marker has returned)
//! ```
//! - `wall` = `t_end − t0` (monotonic clock). Consecutive steps are timed back to back: the next
//!   step's `t0` is taken as soon as the end marker returns, so the walls cover the whole loop
//!   except the end-marker calls, and `rows / sum(wall)` is the loop's speed. That exception is
//!   deliberate: under an observer the end uprobe wakes the observer, which may preempt the
//!   engine right there; the observer's token window closes at the end marker's entry, so that
//!   time belongs to no token on either side (and the engine's printed speed, taken on the loop
//!   clock, still shows it). The observer's window begins at the begin marker, a few
//!   microseconds after `t0`.
//! - `mgmt` = the timed telemetry work: `getrusage` (twice), writing the previous step's row,
//!   `/proc/self/status`, `/proc/meminfo`, `mincore`; plus, with the expert cache, the decode
//!   thread's time in the cache's bookkeeping during the step ([`crate::cache::CacheStats`]).
//! - `io`, `stall`, `read_bytes`, `cache_hit_pct`: with `--experts mmap` 0, 0, 0 and −1 (the
//!   engine makes no explicit reads; page faults are not explicit reads). With the expert cache,
//!   the deltas of the cache's counters over the step (same points as `wall`): `io` = time the
//!   I/O workers spent inside `pread64` (summed over workers: it overlaps compute and may exceed
//!   `wall`), `read_bytes` = the bytes those calls returned, `stall` = the decode thread's waits
//!   for reads, `cache_hit_pct` = hits / (hits + misses) of the experts the step used.
//! - `compute` = `wall − stall − mgmt`: the engine's residual, which silently contains every
//!   page fault, swap-in and reclaim the kernel did on the engine's threads (`io` runs on other
//!   threads, beside compute, and is not subtracted).
//! - `majflt`, `cpu` = `getrusage(RUSAGE_SELF)` deltas between the same points as `wall` (all
//!   threads of the process).
//! - `rss*`, `swap` = `VmRSS`, `RssAnon`, `RssFile`, `VmSwap` of `/proc/self/status` at the end of
//!   the step; `mem_available`, `mem_free`, `swap_free` = `/proc/meminfo` (machine-wide, not the
//!   cgroup's).
//! - `dense_resident_frac` = [`crate::placement::Placement::dense_resident_frac`], sampled at the end
//!   of the first step and then of a step when at least `resident_every` has passed since the
//!   previous sample, and at least 100× what that sample cost (so sampling takes ≤ 1 % of the
//!   time: `mincore` over a file mapping costs ~50 ns per page, 1.2 ms for 90 MiB of dense
//!   weights here); other steps repeat the latest sample. `resident_every` = 0: every step.
//!
//! ## `bmoe_metrics v1` (the CSV written by `--metrics-csv`)
//! ```text
//! # bmoe_metrics v1
//! # model=FILE arch=A n_layer=N n_expert=E n_expert_used=K threads=T n_ctx=C
//! # moe_stream=0 cache_mb=0 … dense_weights=mmap|anon|locked experts=mmap …
//! step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms,majflt,cpu_ms,dense_resident_frac,turn,majflt_mib,cache_budget_mib,rss_mib,rss_anon_mib,rss_file_mib,swap_mib,mem_available_mib,mem_free_mib,swap_free_mib
//! 1,63,12.345,…
//! ```
//! One row per generated-token step (the prompt step is not a row): `step` counts from 1, `steps`
//! is the number of generation steps the run was asked for, `turn` is 0, `majflt_mib` =
//! `majflt × page size`, `cache_budget_mib` = the expert cache's slot memory (−1: no cache). The
//! config line says `moe_stream=1 cache_mb=N io_threads=T o_direct=1 overlap=1 prefetch=0|1
//! experts=cache` for a cache run. Times in ms with 3 decimals, MiB with
//! 1 (`majflt_mib` 2), `cache_hit_pct` 2, `dense_resident_frac` 3. `-1` means not measured.
//! Decode speed as its users quote it is `rows / sum(wall_ms) × 1000` tok/s.
//!
//! `--metrics-json` writes the same: a first line `{"format":"bmoe_metrics v1","model":{…},
//! "config":{…}}` with the two `key=value` lines as objects, then one object per row with the
//! CSV's column names, where not measured is `null` instead of −1.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::cache::{CacheStats, ExpertCache};
use crate::markers::{self, NOT_MEASURED, TokenRecord};
use crate::model::Model;
use crate::placement::page_size;

/// `getrusage(RUSAGE_SELF)`: major faults and user+system CPU time in ns.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub majflt: u64,
    pub cpu_ns: u64,
}

pub fn usage() -> Usage {
    // SAFETY: a zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1_000;
    Usage { majflt: ru.ru_majflt as u64, cpu_ns: tv(ru.ru_utime) + tv(ru.ru_stime) }
}

/// Memory facts at one moment, bytes; `None` = not measured.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MemFacts {
    pub rss: Option<u64>,
    pub rss_anon: Option<u64>,
    pub rss_file: Option<u64>,
    pub swap: Option<u64>,
    pub mem_available: Option<u64>,
    pub mem_free: Option<u64>,
    pub swap_free: Option<u64>,
}

/// `Key:   123 kB` lines of a /proc file, as bytes.
fn kb_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let mut it = rest.split_whitespace();
        let v: u64 = it.next()?.parse().ok()?;
        match it.next() {
            Some("kB") => Some(v * 1024),
            None => Some(v),
            _ => None,
        }
    })
}

/// Reads `/proc/self/status` and `/proc/meminfo` through descriptors kept open (a `pread` at
/// offset 0 regenerates a /proc file, and costs about half of an open-read-close).
/// Parsed by hand, not by procfs, on this per-step path: procfs's `Status` and `Meminfo` parse
/// every field into a map, about 4× this reader's cost (measured here: ~180 µs against ~45 µs).
#[derive(Debug, Default)]
pub struct MemReader {
    status: Option<std::fs::File>,
    meminfo: Option<std::fs::File>,
    buf: Vec<u8>,
    opened: bool,
}

impl MemReader {
    fn read_file(f: Option<&std::fs::File>, buf: &mut Vec<u8>) -> Option<usize> {
        use std::os::unix::fs::FileExt;
        let f = f?;
        if buf.len() < 8192 {
            buf.resize(8192, 0);
        }
        loop {
            let n = f.read_at(buf, 0).ok()?;
            if n < buf.len() {
                return Some(n);
            }
            let l = buf.len() * 2;
            buf.resize(l, 0);
        }
    }

    pub fn read(&mut self) -> MemFacts {
        if !self.opened {
            self.status = std::fs::File::open("/proc/self/status").ok();
            self.meminfo = std::fs::File::open("/proc/meminfo").ok();
            self.opened = true;
        }
        let mut f = MemFacts::default();
        if let Some(n) = Self::read_file(self.status.as_ref(), &mut self.buf) {
            let text = String::from_utf8_lossy(&self.buf[..n]);
            f.rss = kb_field(&text, "VmRSS");
            f.rss_anon = kb_field(&text, "RssAnon");
            f.rss_file = kb_field(&text, "RssFile");
            f.swap = kb_field(&text, "VmSwap");
        }
        if let Some(n) = Self::read_file(self.meminfo.as_ref(), &mut self.buf) {
            let text = String::from_utf8_lossy(&self.buf[..n]);
            f.mem_available = kb_field(&text, "MemAvailable");
            f.mem_free = kb_field(&text, "MemFree");
            f.swap_free = kb_field(&text, "SwapFree");
        }
        f
    }
}

/// One measured step: the marker record plus what the record has no field for.
#[derive(Debug, Clone, Copy)]
pub struct StepSample {
    pub rec: TokenRecord,
    pub mem_free: Option<u64>,
    pub swap_free: Option<u64>,
    /// The expert cache's slot memory, bytes (`None`: no cache).
    pub cache_bytes: Option<u64>,
    /// The expert cache's counters over the step (`None`: no cache).
    pub cache: Option<CacheStats>,
}

/// Measures steps and calls the token markers around them (rules in the module docs). With a
/// [`MetricsWriter`], the row of a generation step is written during the next step (timed as
/// its `mgmt`) or by [`Meter::finish`].
pub struct Meter<'m> {
    model: &'m Model,
    resident_every: Duration,
    last_resident: Option<(Instant, Option<f64>)>,
    /// What the last residency sample cost (mincore over the dense pages).
    resident_cost: Duration,
    mem: MemReader,
    scratch: Vec<u8>,
    writer: Option<MetricsWriter>,
    pending: Option<(u64, StepSample)>,
    write_error: Option<MetricsError>,
    /// End of the previous step (clock, rusage, cache counters), where the next one starts.
    chain: Option<(Instant, Usage, Duration, CacheStats)>,
    cache: Option<&'m ExpertCache>,
}

impl std::fmt::Debug for Meter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Meter(resident every {:?}, {:?})", self.resident_every, self.writer)
    }
}

fn opt(v: Option<u64>) -> u64 {
    v.unwrap_or(NOT_MEASURED)
}

impl<'m> Meter<'m> {
    pub fn new(model: &'m Model, resident_every: Duration, writer: Option<MetricsWriter>) -> Self {
        Meter {
            model,
            resident_every,
            last_resident: None,
            resident_cost: Duration::ZERO,
            mem: MemReader::default(),
            scratch: Vec::new(),
            writer,
            pending: None,
            write_error: None,
            chain: None,
            cache: None,
        }
    }

    /// Measures the expert cache's counters per step too (and tells it each step's index).
    pub fn with_cache(mut self, cache: Option<&'m ExpertCache>) -> Self {
        self.cache = cache;
        self
    }

    fn cache_stats(&self) -> CacheStats {
        self.cache.map(ExpertCache::stats).unwrap_or_default()
    }

    /// The next step starts its clock afresh instead of where the previous step ended (call it
    /// after doing something that belongs to no step, e.g. waiting for input).
    pub fn unchain(&mut self) {
        self.chain = None;
    }

    fn write_pending(&mut self) {
        if let (Some(w), Some((step, s))) = (&mut self.writer, self.pending.take())
            && self.write_error.is_none()
            && let Err(e) = w.row(step, &s)
        {
            self.write_error = Some(e);
        }
    }

    /// Runs `work` as step `index` of `kind` (`markers::KIND_*`) over `n_tokens` tokens. The end
    /// marker fires also when `work` fails (with the record measured so far), so that every
    /// begin has its end. A generation step's sample becomes a metrics row.
    pub fn step<T, E>(
        &mut self,
        kind: u32,
        index: u64,
        n_tokens: u64,
        work: impl FnOnce() -> Result<T, E>,
    ) -> Result<(T, StepSample), E> {
        let mut rec = TokenRecord::new(kind, index, n_tokens);
        // Consecutive steps are timed back to back: this step starts where the previous one's
        // end marker returned, so the walls cover the loop between the steps.
        let (t0, u0, mgmt0, c0) = match self.chain.take() {
            Some(c) => c,
            None => {
                let t = Instant::now();
                let (u, c) = (usage(), self.cache_stats());
                (t, u, t.elapsed(), c)
            }
        };
        if let Some(c) = self.cache {
            c.begin_step(index);
        }
        markers::moe_engine_token_begin(index, &rec);
        let out = work();
        let tm = Instant::now();
        let cache = self.cache.map(|c| c.stats().since(&c0));
        self.write_pending();
        let mem = self.mem.read();
        let due = match self.last_resident {
            None => true,
            Some(_) if self.resident_every.is_zero() => true,
            Some((t, _)) => tm.duration_since(t) >= self.resident_every.max(self.resident_cost * 100),
        };
        if due {
            let ts = Instant::now();
            let f = self.model.placement.dense_resident_frac(&self.model.gguf, &mut self.scratch);
            self.resident_cost = ts.elapsed();
            self.last_resident = Some((tm, f));
        }
        let u1 = usage();
        let t_end = Instant::now();
        let c = cache.unwrap_or_default();
        let mgmt_ns = (mgmt0 + t_end.duration_since(tm)).as_nanos() as u64 + c.mgmt_ns;
        let wall_ns = t_end.duration_since(t0).as_nanos() as u64;
        rec.wall_ns = wall_ns;
        rec.io_ns = c.io_ns;
        rec.stall_ns = c.stall_ns;
        rec.read_bytes = c.read_bytes;
        rec.cache_hit_pct = c.hit_pct().filter(|_| cache.is_some()).unwrap_or(-1.0);
        rec.mgmt_ns = mgmt_ns;
        rec.compute_ns = wall_ns.saturating_sub(mgmt_ns + c.stall_ns);
        rec.majflt = u1.majflt.saturating_sub(u0.majflt);
        rec.cpu_ns = u1.cpu_ns.saturating_sub(u0.cpu_ns);
        rec.dense_resident_frac = self.last_resident.and_then(|(_, f)| f).unwrap_or(-1.0);
        rec.rss_bytes = opt(mem.rss);
        rec.rss_anon_bytes = opt(mem.rss_anon);
        rec.rss_file_bytes = opt(mem.rss_file);
        rec.swap_bytes = opt(mem.swap);
        rec.mem_available_bytes = opt(mem.mem_available);
        markers::moe_engine_token_end(index, &rec);
        // The next step starts when the end marker has returned: time inside it (a uprobe's
        // trap, a preemption on the way back to user space) belongs to no step, as for the
        // observer, whose window closes at the end marker's entry.
        let t_next = Instant::now();
        let (u, cs) = (usage(), self.cache_stats());
        self.chain = Some((t_next, u, t_next.elapsed(), cs));
        let out = out?;
        let sample = StepSample {
            rec,
            mem_free: mem.mem_free,
            swap_free: mem.swap_free,
            cache_bytes: self.cache.map(|c| c.bytes() as u64),
            cache,
        };
        if kind == markers::KIND_GENERATE {
            self.pending = Some((index, sample));
        }
        Ok((out, sample))
    }

    /// Writes the last row and renames the files into place; returns the writer's first error,
    /// if any, and the rows written.
    pub fn finish(mut self) -> Result<u64, MetricsError> {
        self.write_pending();
        if let Some(e) = self.write_error.take() {
            return Err(e);
        }
        let rows = self.writer.as_ref().map_or(0, MetricsWriter::rows);
        if let Some(w) = self.writer.take() {
            w.commit()?;
        }
        Ok(rows)
    }
}

/// The two `key=value` header lines of a `bmoe_metrics v1` file.
#[derive(Debug, Clone, Default)]
pub struct MetricsHeader {
    pub model: Vec<(String, String)>,
    pub config: Vec<(String, String)>,
}

impl MetricsHeader {
    /// Model and run configuration of an engine run (with its expert cache, if any).
    pub fn for_run(
        model: &Model,
        cache: Option<&ExpertCache>,
        threads: usize,
        n_ctx: usize,
        extra: &[(&str, String)],
    ) -> Self {
        let c = &model.cfg;
        let p = &model.placement;
        let file = model.gguf.path().file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned());
        let kv = |k: &str, v: String| (k.to_owned(), v.split_whitespace().collect::<Vec<_>>().join("_"));
        let on = |b: bool| if b { "1" } else { "0" }.to_owned();
        let mut config = vec![
            kv("moe_stream", on(cache.is_some())),
            kv("cache_mb", cache.map_or(0, |c| c.bytes() >> 20).to_string()),
            kv("io_threads", cache.map_or(0, |c| c.config.io_threads).to_string()),
            kv("o_direct", on(cache.is_some())),
            kv("overlap", on(cache.is_some())),
            kv("prefetch", on(cache.is_some_and(|c| c.config.prefetch))),
            kv("dense_weights", p.dense.name().into()),
            kv("experts", if cache.is_some() { "cache" } else { p.experts.name() }.into()),
            kv("dense_bytes", p.dense_bytes.to_string()),
            kv("expert_bytes", p.expert_bytes.to_string()),
        ];
        config.extend(extra.iter().map(|(k, v)| kv(k, v.clone())));
        MetricsHeader {
            model: vec![
                kv("model", file),
                kv("arch", c.arch.name().to_owned()),
                kv("n_layer", c.n_layer.to_string()),
                kv("n_expert", c.n_expert.to_string()),
                kv("n_expert_used", c.n_expert_used.to_string()),
                kv("threads", threads.to_string()),
                kv("n_ctx", n_ctx.to_string()),
            ],
            config,
        }
    }
}

/// The CSV columns of `bmoe_metrics v1`, in order.
pub const COLUMNS: [&str; 22] = [
    "step",
    "steps",
    "wall_ms",
    "io_ms",
    "compute_ms",
    "read_bytes",
    "cache_hit_pct",
    "stall_ms",
    "mgmt_ms",
    "majflt",
    "cpu_ms",
    "dense_resident_frac",
    "turn",
    "majflt_mib",
    "cache_budget_mib",
    "rss_mib",
    "rss_anon_mib",
    "rss_file_mib",
    "swap_mib",
    "mem_available_mib",
    "mem_free_mib",
    "swap_free_mib",
];

/// One row's values (`None` = not measured) with the CSV's decimals.
fn row_values(step: u64, steps: u64, s: &StepSample) -> [(Option<f64>, usize); 22] {
    let r = &s.rec;
    let u = |v: u64| (v != NOT_MEASURED).then_some(v);
    let ms = |v: u64| (u(v).map(|v| v as f64 / 1e6), 3);
    let mib = |v: Option<u64>| (v.map(|v| v as f64 / (1u64 << 20) as f64), 1);
    let frac = |v: f64| (v >= 0.0 && v.is_finite()).then_some(v);
    let page = page_size() as f64;
    [
        (Some(step as f64), 0),
        (Some(steps as f64), 0),
        ms(r.wall_ns),
        ms(r.io_ns),
        ms(r.compute_ns),
        (u(r.read_bytes).map(|v| v as f64), 0),
        (frac(r.cache_hit_pct), 2),
        ms(r.stall_ns),
        ms(r.mgmt_ns),
        (u(r.majflt).map(|v| v as f64), 0),
        ms(r.cpu_ns),
        (frac(r.dense_resident_frac), 3),
        (Some(0.0), 0),
        (u(r.majflt).map(|v| v as f64 * page / (1u64 << 20) as f64), 2),
        mib(s.cache_bytes),
        mib(u(r.rss_bytes)),
        mib(u(r.rss_anon_bytes)),
        mib(u(r.rss_file_bytes)),
        mib(u(r.swap_bytes)),
        mib(u(r.mem_available_bytes)),
        mib(s.mem_free),
        mib(s.swap_free),
    ]
}

/// Writes `--metrics-csv` and/or `--metrics-json` (format in the module docs), one row per
/// generated-token step, flushed per row so that a killed run keeps its complete rows.
pub struct MetricsWriter {
    csv: Option<MetricsFile>,
    json: Option<MetricsFile>,
    steps: u64,
    rows: u64,
}

/// One metrics file: written aside, renamed into place by [`MetricsWriter::commit`]
/// ([`crate::output`]).
struct MetricsFile {
    w: std::io::BufWriter<std::fs::File>,
    pending: crate::output::Pending,
    path: String,
}

impl MetricsFile {
    fn new(out: crate::output::Output) -> MetricsFile {
        let path = out.path().display().to_string();
        let (file, pending) = out.split();
        MetricsFile { w: std::io::BufWriter::new(file), pending, path }
    }

    fn err(&self, source: std::io::Error) -> MetricsError {
        MetricsError { path: self.path.clone(), source }
    }

    fn commit(self) -> Result<(), MetricsError> {
        let path = self.path;
        let file = self.w.into_inner().map_err(|e| MetricsError { path: path.clone(), source: e.into_error() })?;
        self.pending.commit(file).map_err(|e| MetricsError {
            path,
            source: match e {
                crate::output::OutputError::Io { source, .. } => source,
                e => std::io::Error::other(e.to_string()),
            },
        })
    }
}

impl std::fmt::Debug for MetricsWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MetricsWriter({} rows)", self.rows)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct MetricsError {
    pub path: String,
    pub source: std::io::Error,
}

impl MetricsWriter {
    /// Writes the headers into the outputs (created and checked before the run:
    /// [`crate::output`]); `steps` is the `steps` column.
    pub fn create(
        csv: Option<crate::output::Output>,
        json: Option<crate::output::Output>,
        header: &MetricsHeader,
        steps: u64,
    ) -> Result<MetricsWriter, MetricsError> {
        let mut w = MetricsWriter { csv: csv.map(MetricsFile::new), json: json.map(MetricsFile::new), steps, rows: 0 };
        let line = |kv: &[(String, String)]| kv.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        if let Some(f) = &mut w.csv {
            let text = format!(
                "# bmoe_metrics v1\n# {}\n# {}\n{}\n",
                line(&header.model),
                line(&header.config),
                COLUMNS.join(",")
            );
            f.w.write_all(text.as_bytes()).and_then(|()| f.w.flush()).map_err(|e| f.err(e))?;
        }
        if let Some(f) = &mut w.json {
            let obj = |kv: &[(String, String)]| {
                serde_json::Value::Object(
                    kv.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect(),
                )
            };
            let h = serde_json::json!({"format": "bmoe_metrics v1", "model": obj(&header.model), "config": obj(&header.config)});
            writeln!(f.w, "{h}").and_then(|()| f.w.flush()).map_err(|e| f.err(e))?;
        }
        Ok(w)
    }

    /// Syncs the files and renames them into place.
    pub fn commit(self) -> Result<(), MetricsError> {
        for f in [self.csv, self.json].into_iter().flatten() {
            f.commit()?;
        }
        Ok(())
    }

    /// Appends the row of generation step `step` (1-based).
    pub fn row(&mut self, step: u64, s: &StepSample) -> Result<(), MetricsError> {
        let vals = row_values(step, self.steps, s);
        if let Some(f) = &mut self.csv {
            let mut line = String::with_capacity(256);
            for (i, (v, dec)) in vals.iter().enumerate() {
                if i > 0 {
                    line.push(',');
                }
                match v {
                    Some(v) => line.push_str(&format!("{v:.dec$}")),
                    None if *dec == 0 => line.push_str("-1"),
                    None => line.push_str(&format!("{:.dec$}", -1.0)),
                }
            }
            line.push('\n');
            f.w.write_all(line.as_bytes()).and_then(|()| f.w.flush()).map_err(|e| f.err(e))?;
        }
        if let Some(f) = &mut self.json {
            let mut m = serde_json::Map::new();
            for (name, (v, dec)) in COLUMNS.iter().zip(vals) {
                let j = match v {
                    None => serde_json::Value::Null,
                    Some(v) if dec == 0 => serde_json::Value::from(v as u64),
                    Some(v) => serde_json::Value::from(v),
                };
                m.insert((*name).to_owned(), j);
            }
            writeln!(f.w, "{}", serde_json::Value::Object(m)).and_then(|()| f.w.flush()).map_err(|e| f.err(e))?;
        }
        self.rows += 1;
        Ok(())
    }

    pub fn rows(&self) -> u64 {
        self.rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kb_fields_parse() {
        let t = "Name:\tengine\nVmRSS:\t  1234 kB\nRssAnon:\t 10 kB\nThreads:\t2\n";
        assert_eq!(kb_field(t, "VmRSS"), Some(1234 * 1024));
        assert_eq!(kb_field(t, "RssAnon"), Some(10 * 1024));
        assert_eq!(kb_field(t, "Threads"), Some(2));
        assert_eq!(kb_field(t, "VmSwap"), None);
        assert_eq!(kb_field(t, "Vm"), None, "prefix of another key");
    }

    #[test]
    fn mem_reader_reads_this_process() {
        let f = MemReader::default().read();
        assert!(f.rss.unwrap() > 0);
        assert!(f.rss_anon.unwrap() > 0);
        assert!(f.swap.is_some());
        assert!(f.mem_available.unwrap() > 0);
    }

    fn process_cpu_ns() -> u64 {
        // SAFETY: a zeroed timespec is a valid out-parameter.
        let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    #[test]
    fn usage_counts_cpu_time_like_the_process_cpu_clock() {
        // Independent source: CLOCK_PROCESS_CPUTIME_ID (both count every thread of the process).
        let (a, c0) = (usage(), process_cpu_ns());
        let mut x = 0u64;
        while process_cpu_ns() - c0 < 30_000_000 {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let (b, c1) = (usage(), process_cpu_ns());
        let (d, want) = (b.cpu_ns - a.cpu_ns, c1 - c0);
        assert!(d.abs_diff(want) < 5_000_000, "getrusage counted {d} ns, the process CPU clock {want} ns");
    }

    #[test]
    fn row_formatting_uses_minus_one_for_not_measured() {
        let mut rec = TokenRecord::new(markers::KIND_GENERATE, 3, 1);
        rec.wall_ns = 12_345_678;
        rec.majflt = 256;
        let s = StepSample { rec, mem_free: Some(3 << 20), swap_free: None, cache_bytes: None, cache: None };
        let vals = row_values(3, 10, &s);
        assert_eq!(vals[0].0, Some(3.0));
        assert_eq!(vals[2].0, Some(12.345678));
        assert_eq!(vals[4].0, None, "compute not measured");
        assert_eq!(vals[11].0, None, "dense_resident_frac < 0 is not measured");
        assert_eq!(vals[13].0, Some(256.0 * page_size() as f64 / (1u64 << 20) as f64));
        assert_eq!(vals[20].0, Some(3.0));
        assert_eq!(vals[21].0, None);
    }
}
