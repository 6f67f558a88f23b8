//! `observer heatmap MODEL.gguf`: which weights of a model are in the page cache, as a
//! layer × expert grid (no target process needed). Rules: `observer::capture::residency`.
//!
//! ## Output formats
//! - terminal (default): a summary (file, dense, shared experts, routed experts: bytes, share of
//!   the file, resident %), then one row per MoE layer with one coloured cell per expert (or per
//!   group of experts when the terminal is narrower than the grid; the header says how many)
//!   and the layer's resident %, and a legend. With `--churn`, a second grid of the pages
//!   evicted from each expert since the previous refresh. With `--pid PID` (an engine that
//!   publishes its expert cache, `moe_engine_expert_slots`), a grid of the experts ready in the
//!   engine's own cache (anonymous memory, not the page cache), with its slots and the expert
//!   reads since the previous refresh (rules: `observer::capture::residency::slots`). A hit rate
//!   needs the engine's token boundaries, which this command does not see: `observer run` and
//!   the TUI show it. `--pid` also measures the process's explicit reads of the model (eBPF;
//!   rule: `observer_common::xread`, each refresh a span like a `--window`): per kind since the
//!   heatmap attached and since the previous refresh, then a grid of `read_bytes` per expert
//!   since it attached. `--no-reads` goes without (no eBPF). With `--pid` the heatmap ends after
//!   the first refresh that finds the process gone (that refresh holds every read it made).
//! - `--json`: one JSON object per refresh, on one line:
//!   `{"sample", "file", "architecture", "size_bytes", "page_size", "source" ("mincore" |
//!   "cachestat"), "scan_ns", "scan_cpu_ns" (wall and CPU time of the scan), "mincore_pages" (pages the scan asked `mincore` about; chunks that
//!   `cachestat` found empty or full are not), "file_pages", "file_resident_pages", "file_resident_bytes"
//!   (pages × page size, as `fincore` counts), "file_resident_frac", "cachestat" (the kernel's
//!   counts for the whole file, or null), "dense_resident_frac" (dense tensors and shared
//!   experts), "experts_resident_frac" (routed experts) — the token records' residency fields,
//!   same names and meanings (`vocab::RESIDENCY`) —, "regions" ({"dense_tensors",
//!   "shared_experts", "routed_experts"}: each {"bytes", "resident_bytes", "resident_frac"};
//!   `vocab::REGIONS`), "n_layers", "n_experts", "layers" (block index of each row), "resident" (rows of
//!   per-expert fractions), "added" / "evicted" (rows of pages since the previous refresh, or
//!   null without `--churn`), "churn" ({"added_pages", "evicted_pages", "spill_pages",
//!   "dense_added", "dense_evicted"} or null), "evicted_by" (who evicted since the previous
//!   refresh: rows of `residency::evict::ActorRow`, most pages first; null without `--churn`),
//!   "refaulted_by" (pages added back since the previous refresh after an eviction, per kind of
//!   that eviction: {"fadvise": 512, …}; null without `--churn`), "header_pages_dropped",
//!   "engine_cache" (with `--pid`: the token records' `residency.engine_cache`
//!   object, `{"version", "slots", "loading", "ready" (grid cells `row * n_experts + expert`),
//!   "reads" (since the previous refresh), "hit_pct" (null here)}`, plus `"pid"`; null when the
//!   process publishes no cache, or without `--pid`), "reads" (with `--pid`: the explicit reads
//!   since the heatmap attached, in `--trace`'s format below, "records" counting refreshes, plus
//!   `"pid"`, `"exited"` (the process had exited before this refresh) and `"last"` (the reads
//!   since the previous refresh, as a token record's `explicit_reads`); null with `--no-reads`
//!   or without `--pid`)}`. The terminal view shows the same eviction table (since the last refresh) and
//!   the one since the start.
//! - `--csv`: `sample,kind,layer,expert,bytes,resident_bytes,resident_frac,added_pages,evicted_pages`
//!   with one row per kind `file`, `dense_tensors`, `shared_experts`, `routed_experts` (layer,
//!   expert empty) and one per expert (`expert`); unmeasured values are empty.
//!
//! `observer heatmap --trace RUN.trace` (no model needed) lists the explicit reads of a recorded
//! run (rule: `observer::analysis::reads`): a line per kind of region (bytes, calls, time in the
//! calls), the unresolved and lost bytes, then one row per expert read, by layer then expert,
//! with its `read_bytes` and `read_calls` (`vocab::GRID_LAYERS`' names and short labels). When the
//! run measured eviction blame, it then lists what the evictions cost (rule:
//! `observer::analysis::refaults`): per kind of eviction its pages, refaulted pages, refault faults
//! and their `fault_io`; who evicted (processes); and the experts, costliest `fault_io` first, with
//! their evicted pages (`evicted`, `refault_faults`, `refault_io_ns`). With
//! `--json`: one object, `{"trace", "model" (the header's model path or null), "records",
//! "measured" (records with explicit reads), "bytes", "ns", "calls" (per kind: {"dense",
//! "experts", "other"}), "unresolved_bytes", "unresolved_calls", "lost_bytes", "experts": [{"layer",
//! "expert", "read_bytes", "read_calls"}], "sample", "ended" (the trace has its end record),
//! "last_index" (the last record's step index), "target_pid", "refaults" (`RunRefaults::to_json`,
//! or null when not measured)}`. The refault cost needs the run's threads (the attribution
//! programs time each fault), so the model mode below (no target) does not show it. With `--watch` the trace is read again at every
//! refresh, so a run being recorded (`observer record` flushes each burst of records; until its end
//! the trace is `FILE.partial-PID`, `engine::output`, which is read while `FILE` does not exist) is
//! followed live, until its end record. A complete trace without explicit reads is an error that says so.

use std::{io::Write, path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use observer::{
    analysis::reads::RunReads,
    capture::residency::{
        Counts, ModelFile, Part, Snapshot, Source,
        churn::Churn,
        evict::{self, Table},
        slots::SlotTable,
        xread::Live,
    },
};
use observer_common::model::{EngineCache, ExplicitReads};
use observer_common::vocab::{Region, ResidencyField};
use serde_json::{Value, json};

#[derive(Debug, clap::Args)]
pub struct HeatmapArgs {
    /// The GGUF model file (with `--pid`, the one that process has mapped when not given).
    #[arg(required_unless_present_any = ["trace", "pid"])]
    pub model: Option<PathBuf>,
    /// List the explicit reads per expert of a recorded run (`observer record`) instead.
    /// With `--watch`, the trace is read again at every refresh (a run being recorded) until it ends.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["model", "csv", "churn", "pid"])]
    pub trace: Option<PathBuf>,
    /// One JSON object per refresh (see the format in `observer heatmap --help`'s module docs).
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// CSV rows: one per expert and per part of the model.
    #[arg(long)]
    csv: bool,
    /// Refresh until interrupted (or `--count` refreshes).
    #[arg(long)]
    watch: bool,
    /// Time between refreshes with `--watch`.
    #[arg(long, default_value = "1s", value_parser = super::parse_duration)]
    interval: Duration,
    /// Stop after this many refreshes (with `--watch`).
    #[arg(long)]
    count: Option<u64>,
    /// Also count page-cache adds/evictions per expert between refreshes (eBPF, root).
    #[arg(long)]
    churn: bool,
    /// Also show the expert cache of this engine process (its published slot table) and its
    /// explicit reads of the model per expert (eBPF, root); ends when the process exits. Without
    /// MODEL, the GGUF it has mapped is the model (an engine such as llama.cpp found by its PID).
    #[arg(long)]
    pid: Option<u32>,
    /// With `--pid`: do not measure its explicit reads (no eBPF needed).
    #[arg(long, requires = "pid")]
    no_reads: bool,
    /// Grid width in columns (default: the terminal's, or 120).
    #[arg(long)]
    width: Option<usize>,
    /// No colours (also when NO_COLOR is set or stdout is not a terminal).
    #[arg(long)]
    no_color: bool,
}

/// Churn deltas of one refresh.
struct ChurnDelta {
    /// Who evicted since the previous refresh, and since the start (`None`: blame not measured).
    evicted_by: Option<(Table, Table)>,
    added: Vec<u64>,
    evicted: Vec<u64>,
    added_pages: u64,
    evicted_pages: u64,
    spill: u64,
    /// (added, evicted) of the dense tensors and of the shared experts.
    dense_tensors: (u64, u64),
    shared: (u64, u64),
}

impl ChurnDelta {
    /// Dense weights in the vocabulary's sense: dense tensors and shared experts.
    fn dense(&self) -> (u64, u64) {
        (self.dense_tensors.0 + self.shared.0, self.dense_tensors.1 + self.shared.1)
    }
}

fn delta(now: &Counts, last: &Counts) -> ChurnDelta {
    let d = |a: &[u64], b: &[u64]| a.iter().zip(b).map(|(x, y)| x.saturating_sub(*y)).collect::<Vec<_>>();
    ChurnDelta {
        evicted_by: None,
        added: d(&now.cell_added, &last.cell_added),
        evicted: d(&now.cell_evicted, &last.cell_evicted),
        added_pages: now.add_pages.saturating_sub(last.add_pages),
        evicted_pages: now.del_pages.saturating_sub(last.del_pages),
        spill: (now.add_spill + now.del_spill).saturating_sub(last.add_spill + last.del_spill),
        dense_tensors: (now.dense.0.saturating_sub(last.dense.0), now.dense.1.saturating_sub(last.dense.1)),
        shared: (now.shared.0.saturating_sub(last.shared.0), now.shared.1.saturating_sub(last.shared.1)),
    }
}

/// The object, the counters, the last counts, and who evicted at the start and at the last refresh.
type ChurnState = (aya::Ebpf, Churn, Counts, Option<(Table, Table)>);

/// What a refresh shows beside residency: `--churn`'s deltas, and `--pid`'s engine cache and reads.
struct More<'a> {
    churn: Option<&'a ChurnDelta>,
    cache: Option<&'a (u32, Option<EngineCache>)>,
    reads: Option<&'a PidReads<'a>>,
}

/// A grid of the terminal view: one cell's value (0..=1) by grid index, one row's label by row.
type Grid<'a> = dyn Fn(&mut dyn Write, &dyn Fn(usize) -> Option<f64>, &dyn Fn(usize) -> String) -> Result<()> + 'a;

/// `--pid`'s explicit reads at one refresh.
struct PidReads<'a> {
    pid: u32,
    /// The process had exited before this refresh (its last: every read it made is in).
    exited: bool,
    /// Since the heatmap attached (its refreshes are the spans).
    run: RunReads,
    /// Since the previous refresh.
    last: Option<&'a ExplicitReads>,
}

/// Whether process `pid` still runs (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next()).is_some_and(|s| !matches!(s, 'Z' | 'X'))
}

pub fn run(mut args: HeatmapArgs) -> Result<i32> {
    if let Some(trace) = &args.trace {
        return trace_reads(trace, &args);
    }
    let path = match (args.model.take(), args.pid) {
        (Some(p), _) => p,
        (None, Some(pid)) => observer::capture::discover::mapped_gguf(pid).with_context(|| {
            format!(
                "observer heatmap --pid {pid}: process {pid} has no GGUF file mapped (is it running, and does it \
                 load its model with mmap?); give the model file"
            )
        })?,
        (None, None) => bail!("observer heatmap: a model file (or --trace FILE, or --pid PID) is needed"),
    };
    run_model(&path, &args)
}

/// `--trace`: the explicit reads of a recorded run (module doc); with `--watch`, of the trace as it
/// grows (a run being recorded), until its end record or `--count` refreshes.
fn trace_reads(path: &std::path::Path, args: &HeatmapArgs) -> Result<i32> {
    use observer::{
        analysis::refaults::RunRefaults,
        store::import::{LoadedRun, load_events},
    };
    let what = || format!("observer heatmap --trace {}", path.display());
    let mut out = std::io::stdout().lock();
    let mut k = 0u64;
    loop {
        // A run being recorded is at its temporary name until its end (`engine::output`, rule 2).
        let file = match engine::output::partial_paths(path).into_iter().next() {
            Some(p) if !path.exists() => p,
            _ => path.to_path_buf(),
        };
        let e = match load_events(&file) {
            // Renamed into place between the look and the read: read it there.
            Err(_) if file != path && path.exists() => load_events(path),
            r => r,
        }
        .with_context(what)?;
        let run = LoadedRun::from_events(path, e.format, e.events);
        let ended = run.end.is_some();
        if !args.watch || ended {
            for n in e.notes.iter().chain(&run.notes) {
                eprintln!("observer heatmap: {n}");
            }
        }
        let r = RunReads::of(&run.tokens);
        let last_process = run.process.iter().rev().find(|p| !p.evicted_by_process.is_empty());
        let rf = RunRefaults::of(&run.tokens, last_process.map(|p| p.evicted_by_process.as_slice()));
        if r.measured == 0 && rf.grids == 0 && rf.measured == 0 && ended {
            bail!(
                "{}: none of its {} records carries explicit reads or refault costs (recorded before they were measured, without a model file, or without eBPF)",
                path.display(),
                r.records
            );
        }
        let model = run.header.model.as_ref().map(|m| m.path.clone());
        let last_index = run.tokens.last().and_then(|t| t.index);
        if args.json {
            let mut v = r.to_json();
            v["sample"] = json!(k);
            v["trace"] = json!(path.display().to_string());
            v["model"] = json!(model);
            v["ended"] = json!(ended);
            v["last_index"] = json!(last_index);
            v["target_pid"] = json!(run.header.target_pid);
            v["refaults"] = if rf.grids + rf.measured > 0 { rf.to_json() } else { Value::Null };
            writeln!(out, "{v}")?;
        } else {
            if args.watch {
                write!(out, "\x1b[H\x1b[2J")?;
            }
            if r.measured > 0 || rf.grids + rf.measured == 0 {
                render_reads(&mut out, path, model.as_deref(), &r, ended)?;
            }
            if rf.grids + rf.measured > 0 {
                if r.measured > 0 {
                    writeln!(out)?;
                }
                write!(out, "{}", rf.render(TOP_REFAULTED))?;
            }
        }
        out.flush()?;
        k += 1;
        if !args.watch || ended || args.count.is_some_and(|c| k >= c) {
            return Ok(0);
        }
        std::thread::sleep(args.interval);
    }
}

/// Experts listed in the terminal's refault-cost table (`--json` lists all).
const TOP_REFAULTED: usize = 32;

fn render_reads(
    out: &mut impl Write,
    path: &std::path::Path,
    model: Option<&str>,
    r: &observer::analysis::reads::RunReads,
    ended: bool,
) -> Result<()> {
    use observer_common::vocab::{EXPLICIT_READS, G_READ_BYTES, G_READ_CALLS, GRID_LAYERS};
    writeln!(
        out,
        "explicit reads of the model in {} ({}): {} of {} records measured them{}",
        path.display(),
        model.unwrap_or("model unknown"),
        r.measured,
        r.records,
        if ended { "" } else { " (the run goes on, or was cut short)" }
    )?;
    for (k, row) in EXPLICIT_READS.iter().enumerate() {
        writeln!(
            out,
            "  {:<8} {:>12} in {:>8} calls, {:>10.3} ms in the calls",
            row.name,
            mib(r.bytes.0[k]),
            r.calls.0[k],
            r.ns.0[k] as f64 / 1e6
        )?;
    }
    writeln!(
        out,
        "  unresolved {} in {} calls (a descriptor not identified yet) · lost per-expert records: {}",
        mib(r.unresolved_bytes),
        r.unresolved_calls,
        mib(r.lost_bytes)
    )?;
    let (rb, rc) = (&GRID_LAYERS[G_READ_BYTES], &GRID_LAYERS[G_READ_CALLS]);
    writeln!(
        out,
        "{} experts read; per expert ({}: {}; {}: {}):",
        r.experts.len(),
        rb.name,
        rb.help,
        rc.name,
        rc.help
    )?;
    writeln!(out, "{:>6} {:>7} {:>14} {:>8}", "layer", "expert", rb.short, rc.short)?;
    for e in &r.experts {
        writeln!(out, "{:>6} {:>7} {:>14} {:>8}", e.layer, e.expert, e.read_bytes, e.read_calls)?;
    }
    Ok(())
}

fn mib(b: u64) -> String {
    format!("{:.3} MiB", b as f64 / (1u64 << 20) as f64)
}

fn run_model(model_path: &std::path::Path, args: &HeatmapArgs) -> Result<i32> {
    let mut model =
        ModelFile::open(model_path).with_context(|| format!("observer heatmap {}", model_path.display()))?;
    let mut churn_state: Option<ChurnState> = None;
    // Explicit reads are charged on the churn intervals: the churn programs come with them.
    let reads_wanted = args.pid.is_some() && !args.no_reads;
    if args.churn || reads_wanted {
        observer::capture::preflight::check_privileges()?;
        let mut ebpf = observer::capture::residency::churn::load_standalone()?;
        let c = Churn::attach(&mut ebpf, model_path, &model.map, model.file.page)
            .with_context(|| format!("page-cache churn of {}", model_path.display()))?;
        let base = c.read();
        let blame = match c.blame() {
            Some(Ok(t)) => Some((t.clone(), t)),
            Some(Err(e)) => bail!("eviction blame of {}: {e}", model_path.display()),
            None => {
                if let Err(e) = &c.blame {
                    eprintln!("observer heatmap: who evicted is not measured: {e}");
                }
                None
            }
        };
        churn_state = Some((ebpf, c, base, blame));
    }
    let mut live: Option<(Live, Vec<Option<ExplicitReads>>)> = match (args.pid, churn_state.as_mut()) {
        (Some(pid), Some((ebpf, c, _, _))) if reads_wanted => {
            let l = Live::attach(ebpf, pid, model_path, &model.map, &c.intervals, model.file.page)
                .with_context(|| format!("explicit reads of process {pid} (--no-reads goes without)"))?;
            Some((l, Vec::new()))
        }
        _ => None,
    };
    let mut slots = args.pid.map(|pid| (pid, SlotTable::new(pid, &model.map.moe_layers, model.map.n_experts)));
    let color = !args.no_color && observer::style::colour(observer::style::Stream::Stdout);
    let width = args.width.unwrap_or_else(terminal_width);
    let mut out = std::io::stdout().lock();
    let mut k = 0u64;
    loop {
        // A process gone before this refresh makes it the last one, with every read it made.
        let exited = args.pid.is_some_and(|p| !alive(p));
        let snap = model.scan().with_context(|| format!("scanning {}", model_path.display()))?;
        let cache = match slots.as_mut() {
            Some((pid, t)) if !exited => match t.sample() {
                Ok(c) => Some((*pid, c)),
                // Gone since the look above: the next refresh is the last.
                Err(_) if !alive(*pid) => None,
                Err(e) => return Err(e).with_context(|| format!("the expert cache of process {pid}")),
            },
            _ => None,
        };
        let reads = match (live.as_mut(), churn_state.as_ref()) {
            (Some((l, spans)), Some((ebpf, ..))) => {
                spans.push(l.span(ebpf).with_context(|| format!("explicit reads of process {}", l.pid))?);
                let run = RunReads::of_spans(spans.iter().map(Option::as_ref));
                Some(PidReads { pid: l.pid, exited, run, last: spans.last().and_then(Option::as_ref) })
            }
            _ => None,
        };
        let churn = match churn_state.as_mut() {
            Some((_, c, last, blame)) if args.churn => {
                let now = c.read();
                let mut d = delta(&now, last);
                *last = now;
                if let (Some((base, prev)), Some(t)) = (blame.as_mut(), c.blame()) {
                    let t = t.with_context(|| format!("eviction blame of {}", model_path.display()))?;
                    d.evicted_by = Some((t.since(prev), t.since(base)));
                    *prev = t;
                }
                Some(d)
            }
            _ => None,
        };
        if args.json {
            let mut v = json_line(k, &model, &snap, churn.as_ref());
            v["engine_cache"] = match &cache {
                Some((pid, Some(c))) => {
                    let mut c = serde_json::to_value(c)?;
                    c["pid"] = json!(pid);
                    c
                }
                _ => Value::Null,
            };
            v["reads"] = match &reads {
                Some(r) => {
                    let mut j = r.run.to_json();
                    j["pid"] = json!(r.pid);
                    j["exited"] = json!(r.exited);
                    j["last"] = serde_json::to_value(r.last)?;
                    j
                }
                None => Value::Null,
            };
            writeln!(out, "{v}")?;
        } else if args.csv {
            write_csv(&mut out, k, &model, &snap, churn.as_ref())?;
        } else {
            if args.watch {
                write!(out, "\x1b[H\x1b[2J")?;
            }
            let more = More { churn: churn.as_ref(), cache: cache.as_ref(), reads: reads.as_ref() };
            render(&mut out, &model, &snap, &more, width, color)?;
        }
        out.flush()?;
        k += 1;
        if !args.watch || exited || args.count.is_some_and(|c| k >= c) {
            break;
        }
        match live.as_mut() {
            // Answers the kernel's questions about descriptors as they come.
            Some((l, _)) => l.wait(args.interval),
            None => std::thread::sleep(args.interval),
        }
    }
    if let Some((_, c, _, _)) = churn_state.as_ref().filter(|_| args.churn) {
        let n = c.read();
        if n.other_dev_events > 0 && n.add_pages + n.del_pages == 0 {
            bail!(
                "page-cache churn of {}: {} events matched the file's inode on device {:#x} instead of {:#x} (btrfs subvolume or overlayfs?): churn not measured",
                model_path.display(),
                n.other_dev_events,
                n.other_dev_last,
                c.dev
            );
        }
    }
    if let Some((ebpf, _, _, _)) = &mut churn_state {
        observer::capture::bpf::detach_tracepoints(ebpf);
    }
    Ok(0)
}

fn terminal_width() -> usize {
    // SAFETY: TIOCGWINSZ fills a winsize struct we own.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: as above; fd 1 may not be a terminal, then the call fails harmlessly.
    let rc = unsafe { libc::ioctl(1, libc::TIOCGWINSZ, &mut ws) };
    if rc == 0 && ws.ws_col > 0 {
        return ws.ws_col as usize;
    }
    std::env::var("COLUMNS").ok().and_then(|c| c.parse().ok()).unwrap_or(120)
}

fn part_json(p: &Part) -> Value {
    json!({"bytes": p.bytes, "resident_bytes": p.resident_bytes, "resident_frac": p.frac()})
}

fn rows<T: Copy + Into<Value>>(v: &[T], n_experts: usize) -> Value {
    if n_experts == 0 {
        return Value::Array(Vec::new());
    }
    Value::Array(v.chunks(n_experts).map(|r| Value::Array(r.iter().map(|&x| x.into()).collect())).collect())
}

/// The parts of the file by region, in `vocab::REGIONS`' order.
fn regions(s: &Snapshot) -> [(Region, Part); 3] {
    [(Region::DenseTensors, s.dense), (Region::SharedExperts, s.shared), (Region::RoutedExperts, s.experts)]
}

fn json_line(k: u64, m: &ModelFile, s: &Snapshot, churn: Option<&ChurnDelta>) -> Value {
    let n_e = m.map.n_experts as usize;
    let fracs: Vec<f64> = s.cells.iter().map(|c| c.frac().unwrap_or(0.0)).collect();
    let mut v = json!({
        "sample": k,
        "file": m.file.path.display().to_string(),
        "architecture": m.map.architecture,
        "size_bytes": s.file_bytes,
        "page_size": s.page_size,
        "source": s.source,
        "scan_ns": s.scan_ns,
        "scan_cpu_ns": s.scan_cpu_ns,
        "mincore_pages": s.mincore_pages,
        "file_pages": s.file_pages,
        "file_resident_pages": s.file_resident_pages,
        "file_resident_bytes": s.file_resident_pages * s.page_size,
        "cachestat": s.cachestat,
        "regions": regions(s).iter().map(|(r, p)| (r.name().to_string(), part_json(p))).collect::<serde_json::Map<_, _>>(),
        "n_layers": m.map.moe_layers.len(),
        "n_experts": n_e,
        "layers": m.map.moe_layers,
        "resident": rows(&fracs, n_e),
        "added": churn.map(|c| rows(&c.added, n_e)),
        "evicted": churn.map(|c| rows(&c.evicted, n_e)),
        "churn": churn.map(|c| json!({
            "added_pages": c.added_pages,
            "evicted_pages": c.evicted_pages,
            "spill_pages": c.spill,
            "dense_added": c.dense().0,
            "dense_evicted": c.dense().1,
        })),
        "evicted_by": churn.and_then(|c| c.evicted_by.as_ref()).map(|(d, _)| json!(d.rows)),
        "refaulted_by": churn.and_then(|c| c.evicted_by.as_ref()).map(|(d, _)| {
            json!(observer_common::vocab::EVICTION_ACTORS.iter().zip(d.refaults).filter(|x| x.1 > 0)
                .map(|(a, n)| (a.name, n)).collect::<std::collections::BTreeMap<_, _>>())
        }),
        "header_pages_dropped": m.header_pages_dropped,
    });
    for (f, frac) in [
        (ResidencyField::File, s.file_resident_frac()),
        (ResidencyField::DenseResident, s.dense_with_shared().frac()),
        (ResidencyField::ExpertsResident, s.experts.frac()),
    ] {
        v[f.json_key()] = json!(frac);
    }
    v
}

fn write_csv(out: &mut impl Write, k: u64, m: &ModelFile, s: &Snapshot, churn: Option<&ChurnDelta>) -> Result<()> {
    if k == 0 {
        writeln!(out, "sample,kind,layer,expert,bytes,resident_bytes,resident_frac,added_pages,evicted_pages")?;
    }
    let opt = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_default();
    let frac = |f: Option<f64>| f.map(|x| format!("{x:.6}")).unwrap_or_default();
    let file = Part { bytes: s.file_bytes, resident_bytes: (s.file_resident_pages * s.page_size).min(s.file_bytes) };
    let totals = churn.map(|c| (c.added_pages, c.evicted_pages));
    writeln!(
        out,
        "{k},file,,,{},{},{},{},{}",
        file.bytes,
        file.resident_bytes,
        frac(s.file_resident_frac()),
        opt(totals.map(|t| t.0)),
        opt(totals.map(|t| t.1))
    )?;
    for (region, p) in regions(s) {
        let ch = match region {
            Region::DenseTensors => churn.map(|c| c.dense_tensors),
            Region::SharedExperts => churn.map(|c| c.shared),
            Region::RoutedExperts => churn.map(|c| (c.added.iter().sum(), c.evicted.iter().sum())),
        };
        writeln!(
            out,
            "{k},{},,,{},{},{},{},{}",
            region.name(),
            p.bytes,
            p.resident_bytes,
            frac(p.frac()),
            opt(ch.map(|c| c.0)),
            opt(ch.map(|c| c.1))
        )?;
    }
    let n_e = m.map.n_experts as usize;
    for (i, c) in s.cells.iter().enumerate() {
        let layer = m.map.moe_layers[i / n_e];
        let (a, e) = (churn.map(|x| x.added[i]), churn.map(|x| x.evicted[i]));
        writeln!(
            out,
            "{k},expert,{layer},{},{},{},{},{},{}",
            i % n_e,
            c.bytes,
            c.resident_bytes,
            frac(c.frac()),
            opt(a),
            opt(e)
        )?;
    }
    Ok(())
}

/// 256-colour ramp from cold (dark blue) to warm (yellow).
const RAMP: [u8; 16] = [17, 18, 19, 20, 21, 27, 33, 39, 45, 44, 43, 42, 41, 82, 154, 226];
const ASCII: &[u8] = b" .:-=+*#%@";

fn cell(out: &mut String, f: Option<f64>, color: bool) {
    match (f, color) {
        (None, _) => out.push(' '),
        (Some(f), true) => {
            let i = ((f.clamp(0.0, 1.0) * (RAMP.len() - 1) as f64).round()) as usize;
            out.push_str(&format!("\x1b[38;5;{}m█", RAMP[i]));
        }
        (Some(f), false) => {
            let i = ((f.clamp(0.0, 1.0) * (ASCII.len() - 1) as f64).round()) as usize;
            out.push(ASCII[i] as char);
        }
    }
}

fn gib(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

fn pct(f: Option<f64>) -> String {
    f.map(|f| format!("{:5.1} %", 100.0 * f)).unwrap_or_else(|| "    -  ".into())
}

fn render(out: &mut impl Write, m: &ModelFile, s: &Snapshot, more: &More<'_>, width: usize, color: bool) -> Result<()> {
    let More { churn, cache, reads } = *more;
    let reset = if color { "\x1b[0m" } else { "" };
    let n_rows = m.map.moe_layers.len();
    let n_e = m.map.n_experts as usize;
    writeln!(
        out,
        "{} — {}, {}, {n_rows} MoE layers × {n_e} experts ({}, {} B pages, scan {:.1} ms)",
        m.file.path.display(),
        if m.map.architecture.is_empty() { "?" } else { &m.map.architecture },
        gib(s.file_bytes),
        match s.source {
            Source::Mincore => "mincore",
            Source::Cachestat => "cachestat (no permission for mincore: page granularity at region edges)",
        },
        s.page_size,
        s.scan_ns as f64 / 1e6
    )?;
    let cs = s
        .cachestat
        .map(|c| {
            format!(
                "; cachestat: {} pages cached, {} evicted ({} recently)",
                c.nr_cache, c.nr_evicted, c.nr_recently_evicted
            )
        })
        .unwrap_or_default();
    writeln!(
        out,
        "  file     {:>11} resident of {:>11}  {}{cs}",
        gib(s.file_resident_pages * s.page_size),
        gib(s.file_bytes),
        pct(s.file_resident_frac())
    )?;
    for (region, p) in regions(s) {
        if p.bytes == 0 && region == Region::SharedExperts {
            continue;
        }
        let name = region.row().short;
        let share = p.bytes as f64 / s.file_bytes.max(1) as f64;
        writeln!(
            out,
            "  {name:<8} {:>11} resident of {:>11}  {}   ({:.1} % of the file)",
            gib(p.resident_bytes),
            gib(p.bytes),
            pct(p.frac()),
            100.0 * share
        )?;
    }
    if let Some(c) = churn {
        writeln!(
            out,
            "  churn since last refresh: {} pages added, {} evicted (dense {} / {}){}",
            c.added_pages,
            c.evicted_pages,
            c.dense().0,
            c.dense().1,
            if c.spill > 0 {
                format!(", {} pages unattributed (folios over too many regions)", c.spill)
            } else {
                String::new()
            }
        )?;
    }
    if let Some((d, run)) = churn.and_then(|c| c.evicted_by.as_ref()) {
        writeln!(out, "\n  who evicted (since the last refresh):")?;
        for l in evict::render(d, s.page_size).lines() {
            writeln!(out, "    {l}")?;
        }
        writeln!(out, "  who evicted (since the start):")?;
        for l in evict::render(run, s.page_size).lines() {
            writeln!(out, "    {l}")?;
        }
    }
    if n_e == 0 {
        writeln!(out, "  (no routed experts in this model)")?;
        return Ok(());
    }
    let cols = width.saturating_sub(20).max(8).min(n_e);
    let group = n_e.div_ceil(cols);
    let cols = n_e.div_ceil(group);
    writeln!(
        out,
        "\n  resident per expert ({}):",
        if group == 1 { "1 column = 1 expert".to_string() } else { format!("1 column = {group} experts, mean") }
    )?;
    let grid =
        |out: &mut dyn Write, vals: &dyn Fn(usize) -> Option<f64>, label: &dyn Fn(usize) -> String| -> Result<()> {
            for (r, layer) in m.map.moe_layers.iter().enumerate() {
                let mut line = String::new();
                for c in 0..cols {
                    let es = c * group..((c + 1) * group).min(n_e);
                    let v: Vec<f64> = es.filter_map(|e| vals(r * n_e + e)).collect();
                    let f = (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
                    cell(&mut line, f, color);
                }
                writeln!(out, "  {layer:>4} {line}{reset} {}", label(r))?;
            }
            Ok(())
        };
    let frac = |i: usize| s.cells[i].frac();
    let row_label = |r: usize| {
        let row = &s.cells[r * n_e..(r + 1) * n_e];
        let (b, res) = row.iter().fold((0, 0), |a, c| (a.0 + c.bytes, a.1 + c.resident_bytes));
        pct((b > 0).then(|| res as f64 / b as f64))
    };
    grid(out, &frac, &row_label)?;
    let mut legend = String::new();
    for i in 0..=10 {
        cell(&mut legend, Some(i as f64 / 10.0), color);
    }
    writeln!(out, "  legend: 0 % {legend}{reset} 100 % resident")?;
    if let Some(c) = churn {
        let max = c.evicted.iter().copied().max().unwrap_or(0);
        writeln!(out, "\n  pages evicted per expert since last refresh (log scale, max {max}):")?;
        let lmax = ((max + 1) as f64).ln().max(1e-9);
        let ev = |i: usize| Some(((c.evicted[i] + 1) as f64).ln() / lmax);
        let ev_label = |r: usize| format!("{:>8}", c.evicted[r * n_e..(r + 1) * n_e].iter().sum::<u64>());
        grid(out, &ev, &ev_label)?;
    }
    match cache {
        None => {}
        Some((pid, None)) => writeln!(out, "\n  engine cache of process {pid}: none published")?,
        Some((pid, Some(c))) => {
            writeln!(
                out,
                "\n  in the engine's cache (process {pid}: {} slots, {} ready, {} loading, {} expert reads since the last refresh; 1 column as above):",
                c.slots,
                c.ready.len(),
                c.loading,
                c.reads.map_or_else(|| "-".to_string(), |r| r.to_string())
            )?;
            let mut cached = vec![false; s.cells.len()];
            for &i in &c.ready {
                if let Some(x) = cached.get_mut(i as usize) {
                    *x = true;
                }
            }
            let val = |i: usize| Some(if cached[i] { 1.0 } else { 0.0 });
            let label = |r: usize| format!("{:>8}", cached[r * n_e..(r + 1) * n_e].iter().filter(|&&x| x).count());
            grid(out, &val, &label)?;
        }
    }
    if let Some(r) = reads {
        render_pid_reads(out, m, r, &grid)?;
    }
    Ok(())
}

/// `--pid`'s explicit reads: per kind since the start and the last refresh, then a grid of
/// `read_bytes` per expert since the start (shade against the most-read expert).
fn render_pid_reads(out: &mut impl Write, m: &ModelFile, r: &PidReads<'_>, grid: &Grid<'_>) -> Result<()> {
    use observer_common::vocab::{EXPLICIT_READS, G_READ_BYTES, G_READ_CALLS, GRID_LAYERS};
    writeln!(
        out,
        "\n  explicit reads of the model by process {} since the heatmap attached{}:",
        r.pid,
        if r.exited { " (the process has exited: all of them)" } else { "" }
    )?;
    for (k, row) in EXPLICIT_READS.iter().enumerate() {
        let last = r.last.map_or((0, 0), |x| (x.bytes.0[k], x.calls.0[k]));
        writeln!(
            out,
            "  {:<8} {:>12} in {:>8} calls ({} in {} since the last refresh)",
            row.name,
            mib(r.run.bytes.0[k]),
            r.run.calls.0[k],
            mib(last.0),
            last.1
        )?;
    }
    writeln!(
        out,
        "  unresolved {} in {} calls (a descriptor not identified yet) · lost per-expert records: {}",
        mib(r.run.unresolved_bytes),
        r.run.unresolved_calls,
        mib(r.run.lost_bytes)
    )?;
    let n_e = m.map.n_experts as usize;
    let mut bytes = vec![0u64; m.map.moe_layers.len() * n_e];
    for e in &r.run.experts {
        if let Some(row) = m.map.moe_layers.iter().position(|&l| l == e.layer)
            && (e.expert as usize) < n_e
        {
            bytes[row * n_e + e.expert as usize] += e.read_bytes;
        }
    }
    let max = bytes.iter().copied().max().unwrap_or(0).max(1);
    let (rb, rc) = (&GRID_LAYERS[G_READ_BYTES], &GRID_LAYERS[G_READ_CALLS]);
    writeln!(out, "  {} per expert (shade against the most-read expert, {}; 1 column as above):", rb.name, mib(max))?;
    let val = |i: usize| Some(bytes[i] as f64 / max as f64);
    let label = |row: usize| mib(bytes[row * n_e..(row + 1) * n_e].iter().sum());
    grid(out, &val, &label)?;
    writeln!(out, "  ({} per expert: `observer heatmap --pid {} --json`)", rc.name, r.pid)?;
    Ok(())
}
