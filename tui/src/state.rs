//! The TUI's state: everything the views draw, built only from the model
//! stream (`observer_common::model::Event`), so that a live run and a replayed
//! trace go through the same cursor ([`App::push`]).
//!
//! Rules:
//! - Aggregates are kept per step kind; "per token" means per step of the
//!   main kind (a generated token, a `--token-symbol` call, or a window).
//! - A mean of a component or counter is over the steps that *measured* it;
//!   with none it is `None` and the views say "not measured", never 0.
//! - Rates: tokens per second over the generate and call steps (see
//!   [`crate::stats`]), on the decode clock: a step's *cycle* runs from its
//!   start to the start of the next such step, so the time between marked
//!   steps (sampling outside the markers, the probes' own trap cost) counts,
//!   as it does in an engine's own tok/s; a gap longer than the step itself
//!   and than [`IDLE_GAP_NS`] is idle time (waiting for a request) and does
//!   not count: that step's cycle is its wall. (The floor keeps a run-queue
//!   wait between two short steps on a busy machine in the rate, as the
//!   engine's own clock has it: 1.4 ms steps with a few ms of preemption
//!   between some of them read 9 % above the engine's tok/s without it.) The last step's cycle is its wall. "now" is over the
//!   last [`NOW_STEPS`] cycles. The rate over step walls alone (`observer
//!   run`'s summary) is kept beside it.
//! - The token list keeps the last [`MAX_ROWS`] steps; aggregates and the
//!   rate interval cover the whole run.
//! - Who evicted: the steps' `evicted_by` (pages per actor kind) summed over the run, and over
//!   the steps that started in the last [`RECENT_NS`] before the newest step; the steps'
//!   `refaults` (pages, faults and their `fault_io` per kind of the eviction they undid) summed
//!   over the run; and the latest per-process list (`ProcessEvictions`, cumulative) of a process
//!   sample or the run's totals ([`Evictions`]).
//! - While paused, events queue (up to [`MAX_PENDING`], then dropped and
//!   counted) and are applied on resume.

use std::collections::{BTreeMap, VecDeque};

use observer_common::model::{
    Component, Components, Counter, Counters, EngineCache, Event, EvictedBy, ExpertGrid, LatencyHistograms,
    ObserverHealth, ProcessEvictions, ProcessSample, Refaults, RunEnd, RunHeader, StepKind, TokenRecord,
};

use crate::stats::{self, RateInterval};

/// The "last minute" of the who-evicted table, on the steps' clock.
pub const RECENT_NS: u64 = 60_000_000_000;

/// Evicted model-file pages per actor kind: over the run and over the last [`RECENT_NS`].
#[derive(Clone, Debug, Default)]
pub struct Evictions {
    /// Steps that carried a split (`None` before the first: not measured).
    pub run: Option<EvictedBy>,
    /// `(start_ns, split)` of the recent steps, oldest first.
    recent: VecDeque<(u64, EvictedBy)>,
    /// Refaults over the run, per kind (`None` before the first step that carried them).
    pub refaults: Option<Refaults>,
    /// Who evicted, per process, so far (the latest list; empty before the first).
    pub processes: Vec<ProcessEvictions>,
}

impl Evictions {
    fn add(&mut self, start_ns: u64, by: &EvictedBy) {
        let run = self.run.get_or_insert_with(EvictedBy::default);
        for (r, v) in run.0.iter_mut().zip(by.0) {
            *r += v;
        }
        self.recent.push_back((start_ns, *by));
        let newest = self.recent.iter().map(|x| x.0).max().unwrap_or(start_ns);
        while self.recent.front().is_some_and(|x| x.0 + RECENT_NS < newest) {
            self.recent.pop_front();
        }
    }

    fn add_refaults(&mut self, r: &Refaults) {
        let run = self.refaults.get_or_insert_with(Refaults::default);
        for (sum, add) in
            [(&mut run.pages, &r.pages), (&mut run.faults, &r.faults), (&mut run.fault_io_ns, &r.fault_io_ns)]
        {
            for (s, v) in sum.0.iter_mut().zip(add.0) {
                *s += v;
            }
        }
    }

    /// Pages per kind over the last [`RECENT_NS`].
    pub fn recent(&self) -> EvictedBy {
        let mut e = EvictedBy::default();
        for (_, by) in &self.recent {
            for (r, v) in e.0.iter_mut().zip(by.0) {
                *r += v;
            }
        }
        e
    }
}

/// Steps behind the "now" rate.
pub const NOW_STEPS: usize = 16;
/// A gap between two steps at most this long is never idle time (module doc): an engine that
/// waits for a request waits longer; a run-queue wait on a loaded machine is shorter.
pub const IDLE_GAP_NS: u64 = 100_000_000;
/// Token rows kept for the Tokens view.
pub const MAX_ROWS: usize = 50_000;
/// Events queued while paused.
pub const MAX_PENDING: usize = 200_000;
/// Tokens during which a churned expert stays highlighted.
pub const CHURN_WINDOW: u64 = 8;
/// Lines of the target's output kept.
pub const MAX_OUTPUT_LINES: usize = 200;

/// The views, in tab order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum View {
    Tokens,
    Summary,
    Heatmap,
    Threads,
    Faults,
}

impl View {
    pub const ALL: [View; 5] = [View::Tokens, View::Summary, View::Heatmap, View::Threads, View::Faults];

    pub const fn title(self) -> &'static str {
        match self {
            View::Tokens => "Tokens",
            View::Summary => "Summary",
            View::Heatmap => "Heatmap",
            View::Threads => "Threads",
            View::Faults => "Faults",
        }
    }

    pub fn index(self) -> usize {
        View::ALL.iter().position(|&v| v == self).unwrap_or(0)
    }

    fn offset(self, by: isize) -> View {
        let n = View::ALL.len() as isize;
        View::ALL[(self.index() as isize + by).rem_euclid(n) as usize]
    }
}

/// What a key asks for (see `input`); applied by [`App::apply`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    Quit,
    SwitchView(View),
    NextView,
    PrevView,
    TogglePause,
    Scroll(Scroll),
    /// The heatmap's next [`HeatLayer`] of residency and reads.
    NextHeatLayer,
    /// The heatmap's refault-cost layer, or back to residency from it.
    ToggleRefaultLayer,
}

/// What the heatmap's cells show (`vocab::GRID_LAYERS`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HeatLayer {
    /// Resident fraction, coloured by recent churn (`resident`, `added`, `evicted`).
    #[default]
    Residency,
    /// Explicit-read bytes over the run, coloured where read recently (`read_bytes`, `read_calls`).
    Reads,
    /// Refault `fault_io` over the run, coloured where refaulted recently (`refault_faults`,
    /// `refault_io_ns`).
    Refaults,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scroll {
    /// Toward older tokens / the top of a table.
    Up(usize),
    Down(usize),
    PageUp,
    PageDown,
    Top,
    /// The newest token (and follow new ones) / the end of a table.
    Bottom,
}

/// Whether the loop goes on after an effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    Quit,
}

/// One step as the Tokens view needs it (a `TokenRecord` without the
/// per-thread and residency detail).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenRow {
    pub seq: u64,
    pub index: Option<u64>,
    pub kind: StepKind,
    pub n_tokens: u64,
    pub start_ns: u64,
    pub wall_ns: u64,
    pub components: Components,
    pub residual_ns: i64,
    pub counters: Counters,
    pub engine_compute_ns: Option<u64>,
    pub lost_events: u64,
}

impl TokenRow {
    fn of(t: &TokenRecord) -> Self {
        TokenRow {
            seq: t.seq,
            index: t.index,
            kind: t.kind,
            n_tokens: t.n_tokens,
            start_ns: t.start_ns,
            wall_ns: t.wall_ns,
            components: t.components,
            residual_ns: t.residual_ns,
            counters: t.counters,
            engine_compute_ns: t.engine_compute_ns,
            lost_events: t.lost_events,
        }
    }

    /// engine compute − measured compute (the hidden cost), when both exist.
    pub fn hidden_ns(&self) -> Option<i64> {
        Some(self.engine_compute_ns? as i64 - self.components.get(Component::Compute)? as i64)
    }
}

/// A sum over the values that were measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sum {
    pub n: u64,
    pub total: f64,
}

impl Sum {
    pub fn add(&mut self, v: Option<f64>) {
        if let Some(v) = v {
            self.n += 1;
            self.total += v;
        }
    }
    pub fn mean(&self) -> Option<f64> {
        (self.n > 0).then(|| self.total / self.n as f64)
    }
}

/// Run-long sums over steps of one kind.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Agg {
    pub steps: u64,
    pub tokens: u64,
    pub wall_ns: Sum,
    pub components: [Sum; Component::N],
    pub residual_ns: Sum,
    pub counters: [Sum; Counter::N],
    pub engine_compute_ns: Sum,
    pub hidden_ns: Sum,
}

impl Agg {
    fn add(&mut self, t: &TokenRecord) {
        self.steps += 1;
        self.tokens += t.n_tokens;
        self.wall_ns.add(Some(t.wall_ns as f64));
        for c in Component::ALL {
            self.components[c as usize].add(t.components.get(c).map(|v| v as f64));
        }
        self.residual_ns.add(Some(t.residual_ns as f64));
        for c in Counter::ALL {
            self.counters[c as usize].add(t.counters.get(c).map(|v| v as f64));
        }
        self.engine_compute_ns.add(t.engine_compute_ns.map(|v| v as f64));
        self.hidden_ns.add(t.hidden_ns().map(|v| v as f64));
    }
    pub fn component(&self, c: Component) -> &Sum {
        &self.components[c as usize]
    }
    pub fn counter(&self, c: Counter) -> &Sum {
        &self.counters[c as usize]
    }
}

/// One thread over the run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ThreadAgg {
    pub tid: u32,
    pub comm: String,
    /// Steps the thread took part in.
    pub steps: u64,
    pub components: [Sum; Component::N],
    pub counters: [Sum; Counter::N],
    pub residual_ns: Sum,
    /// Components of the last step it took part in.
    pub last: Components,
    pub last_seq: u64,
}

impl ThreadAgg {
    /// Measured time of the thread over the run (ns).
    pub fn total_ns(&self) -> f64 {
        self.components.iter().map(|s| s.total).sum()
    }
}

/// Expert residency as last reported, and where it churned recently.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Heat {
    /// Any token carried a `residency` (else the view says "not measured").
    pub measured: bool,
    pub dense_resident_frac: Option<f64>,
    pub dense_swapped_frac: Option<f64>,
    pub experts_resident_frac: Option<f64>,
    pub grid: Option<ExpertGrid>,
    /// Seq of the step the grid is from.
    pub grid_seq: u64,
    /// Per cell: seq of the last step in which pages were added / evicted.
    pub last_added: Vec<Option<u64>>,
    pub last_evicted: Vec<Option<u64>>,
    /// Pages added / evicted over the grid's last step, and over the run.
    pub step_added: Option<u64>,
    pub step_evicted: Option<u64>,
    pub run_added: u64,
    pub run_evicted: u64,
    /// The engine's expert cache as its slot table showed it last (`residency.engine_cache`),
    /// with the step it came with.
    pub engine_cache: Option<(u64, EngineCache)>,
    /// The engine's own hit rate (`cache_hit_pct` of its telemetry) of that step.
    pub engine_hit_pct: Option<f64>,
    /// The observer's hit rates over the run: (sum, count) of the steps that measured one.
    pub hit_pct_sum: (f64, u64),
    /// What the cells show.
    pub layer: HeatLayer,
    /// Any grid carried the read layers (else the reads layer says "not measured").
    pub reads_measured: bool,
    /// Per cell: explicit-read bytes and calls over the run (the grids' `read_bytes`, `read_calls`).
    pub run_read_bytes: Vec<u64>,
    pub run_read_calls: Vec<u64>,
    /// Per cell: seq of the last step whose grid had a read of it.
    pub last_read: Vec<Option<u64>>,
    /// (bytes, calls) of the grid's last step, and over the run.
    pub step_reads: Option<(u64, u64)>,
    pub run_reads: (u64, u64),
    /// Any grid carried the refault layers.
    pub refaults_measured: bool,
    /// Per cell: refault faults and their `fault_io` ns over the run (the grids' `refault_faults`,
    /// `refault_io_ns`), and the seq of the last step whose grid had a refault fault of it.
    pub run_refault_faults: Vec<u64>,
    pub run_refault_io: Vec<u64>,
    pub last_refault: Vec<Option<u64>>,
    /// (faults, `fault_io` ns) of the grid's last step, and over the run.
    pub step_refaults: Option<(u64, u64)>,
    pub run_refaults: (u64, u64),
}

impl Heat {
    /// The observer's mean hit rate over the steps that measured one.
    pub fn run_hit_pct(&self) -> Option<f64> {
        let (sum, n) = self.hit_pct_sum;
        (n > 0).then(|| sum / n as f64)
    }

    /// Whether grid cell `i` was in the engine's cache at its last snapshot.
    pub fn in_engine_cache(&self, i: u32) -> bool {
        self.engine_cache.as_ref().is_some_and(|(_, c)| c.ready.binary_search(&i).is_ok())
    }

    fn add(&mut self, seq: u64, r: &observer_common::model::Residency, engine_hit_pct: Option<f64>) {
        self.measured = true;
        if let Some(c) = &r.engine_cache {
            if let Some(h) = c.hit_pct {
                self.hit_pct_sum.0 += h;
                self.hit_pct_sum.1 += 1;
            }
            self.engine_cache = Some((seq, c.clone()));
            self.engine_hit_pct = engine_hit_pct;
        }
        self.dense_resident_frac = r.dense_resident_frac.or(self.dense_resident_frac);
        self.dense_swapped_frac = r.dense_swapped_frac.or(self.dense_swapped_frac);
        self.experts_resident_frac = r.experts_resident_frac.or(self.experts_resident_frac);
        let Some(g) = &r.grid else { return };
        let cells = g.n_layers as usize * g.n_experts as usize;
        let same_shape =
            self.grid.as_ref().is_some_and(|old| old.n_layers == g.n_layers && old.n_experts == g.n_experts);
        if !same_shape {
            self.last_added = vec![None; cells];
            self.last_evicted = vec![None; cells];
            self.last_read = vec![None; cells];
            self.run_read_bytes = vec![0; cells];
            self.run_read_calls = vec![0; cells];
            self.last_refault = vec![None; cells];
            self.run_refault_faults = vec![0; cells];
            self.run_refault_io = vec![0; cells];
        }
        let mark = |last: &mut Vec<Option<u64>>, v: &Option<Vec<u32>>| -> Option<u64> {
            let v = v.as_ref()?;
            let mut sum = 0u64;
            for (i, &n) in v.iter().enumerate().take(cells) {
                if n > 0 {
                    last[i] = Some(seq);
                    sum += n as u64;
                }
            }
            Some(sum)
        };
        self.step_added = mark(&mut self.last_added, &g.added);
        self.step_evicted = mark(&mut self.last_evicted, &g.evicted);
        self.run_added += self.step_added.unwrap_or(0);
        self.run_evicted += self.step_evicted.unwrap_or(0);
        self.step_reads = None;
        if let (Some(b), Some(c)) = (&g.read_bytes, &g.read_calls) {
            self.reads_measured = true;
            let mut step = (0u64, 0u64);
            for (i, (&b, &c)) in b.iter().zip(c).enumerate().take(cells) {
                if b > 0 || c > 0 {
                    self.last_read[i] = Some(seq);
                }
                self.run_read_bytes[i] += b;
                self.run_read_calls[i] += u64::from(c);
                step = (step.0 + b, step.1 + u64::from(c));
            }
            self.run_reads = (self.run_reads.0 + step.0, self.run_reads.1 + step.1);
            self.step_reads = Some(step);
        }
        self.step_refaults = None;
        if let (Some(f), Some(io)) = (&g.refault_faults, &g.refault_io_ns) {
            self.refaults_measured = true;
            let mut step = (0u64, 0u64);
            for (i, (&f, &io)) in f.iter().zip(io).enumerate().take(cells) {
                if f > 0 {
                    self.last_refault[i] = Some(seq);
                }
                self.run_refault_faults[i] += u64::from(f);
                self.run_refault_io[i] += io;
                step = (step.0 + u64::from(f), step.1 + io);
            }
            self.run_refaults = (self.run_refaults.0 + step.0, self.run_refaults.1 + step.1);
            self.step_refaults = Some(step);
        }
        self.grid = Some(g.clone());
        self.grid_seq = seq;
    }

    /// Whether cell `i` was read within [`CHURN_WINDOW`] steps of the grid.
    pub fn read_recently(&self, i: usize) -> bool {
        self.last_read.get(i).copied().flatten().is_some_and(|s| s + CHURN_WINDOW > self.grid_seq)
    }

    /// Whether cell `i` had a refault fault within [`CHURN_WINDOW`] steps of the grid.
    pub fn refaulted_recently(&self, i: usize) -> bool {
        self.last_refault.get(i).copied().flatten().is_some_and(|s| s + CHURN_WINDOW > self.grid_seq)
    }

    /// (added, evicted) recently, for cell `i` (within [`CHURN_WINDOW`] steps of the grid).
    pub fn churn(&self, i: usize) -> (bool, bool) {
        let recent =
            |v: &Vec<Option<u64>>| v.get(i).copied().flatten().is_some_and(|s| s + CHURN_WINDOW > self.grid_seq);
        (recent(&self.last_added), recent(&self.last_evicted))
    }
}

/// The whole state.
#[derive(Clone, Debug)]
pub struct App {
    pub header: Option<RunHeader>,
    pub end: Option<RunEnd>,
    /// Last [`MAX_ROWS`] steps, oldest first.
    pub rows: VecDeque<TokenRow>,
    /// Steps ever received (rows may have forgotten the oldest).
    pub steps_seen: u64,
    /// Aggregates per step kind (indexed by [`kind_index`]).
    pub aggs: [Agg; 4],
    /// `(n_tokens, cycle_ns)` of every generate/call step (module doc), for the interval.
    pub rate_steps: Vec<(u64, u64)>,
    /// Σ n_tokens, Σ cycle_ns and Σ wall_ns of those steps (always current).
    rate_sums: (u128, u128, u128),
    /// `(start_ns, wall_ns)` of the last generate/call step, while the next may extend its cycle.
    last_rate_step: Option<(u64, u64)>,
    pub rate: Option<RateInterval>,
    rate_steps_at: usize,
    pub threads: BTreeMap<u32, ThreadAgg>,
    pub heat: Heat,
    pub evictions: Evictions,
    pub process: Option<ProcessSample>,
    /// The latest cumulative latency histograms (`Event::Histograms`).
    pub latency: Option<LatencyHistograms>,
    /// The observer's latest health and cost (`Event::Health`).
    pub health: Option<ObserverHealth>,
    /// Sum of the steps' `lost_events`.
    pub lost_in_steps: u64,
    /// Events the consumer dropped before they reached the state (set by the source).
    pub dropped: u64,
    /// Events dropped here while paused with a full queue.
    pub dropped_paused: u64,
    /// The source has no more events (a replay finished, or the live run ended).
    pub source_done: bool,
    /// The last lines the target (and the observer) printed while the TUI was up.
    pub output: VecDeque<String>,
    // --- UI ---
    pub view: View,
    pub paused: bool,
    pending: VecDeque<Event>,
    /// Tokens view: rows hidden below the window (0 = follow the newest).
    pub tokens_offset: usize,
    /// Other views: first row shown.
    pub table_offset: [usize; 5],
    /// Terminal size, for page sizes.
    pub viewport: (u16, u16),
    dirty: bool,
    switched_on_end: bool,
}

impl Default for App {
    fn default() -> Self {
        Self::new()
    }
}

pub const fn kind_index(k: StepKind) -> usize {
    match k {
        StepKind::Prompt => 0,
        StepKind::Generate => 1,
        StepKind::Call => 2,
        StepKind::Window => 3,
    }
}

impl App {
    pub fn new() -> Self {
        App {
            header: None,
            end: None,
            rows: VecDeque::new(),
            steps_seen: 0,
            aggs: Default::default(),
            rate_steps: Vec::new(),
            rate_sums: (0, 0, 0),
            last_rate_step: None,
            rate: None,
            rate_steps_at: 0,
            threads: BTreeMap::new(),
            heat: Heat::default(),
            evictions: Evictions::default(),
            process: None,
            latency: None,
            health: None,
            lost_in_steps: 0,
            dropped: 0,
            dropped_paused: 0,
            source_done: false,
            output: VecDeque::new(),
            view: View::Tokens,
            paused: false,
            pending: VecDeque::new(),
            tokens_offset: 0,
            table_offset: [0; 5],
            viewport: (80, 24),
            dirty: true,
            switched_on_end: false,
        }
    }

    /// Feed one event of the model stream (live or replay).
    pub fn push(&mut self, ev: Event) {
        if self.paused {
            if self.pending.len() >= MAX_PENDING {
                self.dropped_paused += 1;
            } else {
                self.pending.push_back(ev);
            }
            return;
        }
        self.apply_event(ev);
    }

    fn apply_event(&mut self, ev: Event) {
        self.dirty = true;
        match ev {
            Event::Header(h) => self.header = Some(h),
            Event::Marks(m) => {
                if let Some(h) = &mut self.header {
                    h.apply(&m);
                }
            }
            Event::Token(t) => self.add_token(&t),
            Event::Process(p) => {
                if !p.evicted_by_process.is_empty() {
                    self.evictions.processes = p.evicted_by_process.clone();
                }
                self.process = Some(p);
            }
            Event::Histograms(h) => self.latency = Some(h),
            Event::Health(h) => self.health = Some(h),
            Event::Totals(t) => {
                if !t.evicted_by_process.is_empty() {
                    self.evictions.processes = t.evicted_by_process;
                }
            }
            Event::End(e) => {
                self.end = Some(e);
                if !self.switched_on_end {
                    // The final summary stays on screen until the user quits.
                    self.switched_on_end = true;
                    self.view = View::Summary;
                }
                self.refresh_stats();
            }
        }
    }

    fn add_token(&mut self, t: &TokenRecord) {
        self.steps_seen += 1;
        self.lost_in_steps += t.lost_events;
        self.aggs[kind_index(t.kind)].add(t);
        if matches!(t.kind, StepKind::Generate | StepKind::Call) {
            if let (Some((start, wall)), Some(last)) = (self.last_rate_step, self.rate_steps.last_mut()) {
                let end = start.saturating_add(wall);
                if t.start_ns >= end && t.start_ns - end <= wall.max(IDLE_GAP_NS) {
                    let cycle = t.start_ns - start;
                    self.rate_sums.1 += (cycle - last.1) as u128;
                    last.1 = cycle;
                }
            }
            self.rate_steps.push((t.n_tokens, t.wall_ns));
            self.rate_sums.0 += t.n_tokens as u128;
            self.rate_sums.1 += t.wall_ns as u128;
            self.rate_sums.2 += t.wall_ns as u128;
            self.last_rate_step = Some((t.start_ns, t.wall_ns));
        } else {
            // A prompt (or a window) between two steps: no cycle spans it.
            self.last_rate_step = None;
        }
        if self.rows.len() >= MAX_ROWS {
            self.rows.pop_front();
        }
        self.rows.push_back(TokenRow::of(t));
        if self.tokens_offset > 0 {
            // Scrolled back: keep the same rows on screen.
            self.tokens_offset += 1;
        }
        for th in &t.threads {
            let a = self.threads.entry(th.tid).or_insert_with(|| ThreadAgg { tid: th.tid, ..Default::default() });
            if a.comm != th.comm {
                a.comm = th.comm.clone();
            }
            a.steps += 1;
            for c in Component::ALL {
                a.components[c as usize].add(th.components.get(c).map(|v| v as f64));
            }
            for c in Counter::ALL {
                a.counters[c as usize].add(th.counters.get(c).map(|v| v as f64));
            }
            a.residual_ns.add(Some(th.residual_ns as f64));
            a.last = th.components;
            a.last_seq = t.seq;
        }
        if let Some(r) = &t.residency {
            self.heat.add(t.seq, r, t.engine.as_ref().and_then(|e| e.cache_hit_pct));
        }
        if let Some(by) = &t.evicted_by {
            self.evictions.add(t.start_ns, by);
        }
        if let Some(r) = &t.refaults {
            self.evictions.add_refaults(r);
        }
    }

    /// Recompute the rate interval if steps arrived since the last time. The
    /// loop calls this every [`crate::term::STATS_EVERY`] (a few ms each: see
    /// [`stats::resamples_for`]); after the end it uses
    /// [`stats::final_resamples_for`], once.
    pub fn refresh_stats(&mut self) {
        let n = self.rate_steps.len();
        let b = if self.ended() { stats::final_resamples_for(n) } else { stats::resamples_for(n) };
        if n == self.rate_steps_at && self.rate.is_some_and(|r| r.resamples >= b || r.ci95.is_none()) {
            return;
        }
        self.rate_steps_at = n;
        self.rate = stats::rate_interval(&self.rate_steps, b, stats::SEED);
        self.dirty = true;
    }

    /// Tokens per second over all generate/call steps so far, on the decode
    /// clock (module doc; the interval in [`App::rate`] may lag it by a refresh).
    pub fn rate_run(&self) -> Option<f64> {
        let (n, cycles, _) = self.rate_sums;
        (cycles > 0).then(|| n as f64 * 1e9 / cycles as f64)
    }

    /// Tokens per second over the steps' own walls only (`observer run`'s figure).
    pub fn rate_in_steps(&self) -> Option<f64> {
        let (n, _, walls) = self.rate_sums;
        (walls > 0).then(|| n as f64 * 1e9 / walls as f64)
    }

    /// Tokens per second over the last [`NOW_STEPS`] generate/call step cycles.
    pub fn rate_now(&self) -> Option<f64> {
        let n = self.rate_steps.len();
        stats::rate(self.rate_steps[n.saturating_sub(NOW_STEPS)..].iter().copied())
    }

    /// The step kind that "per token" refers to: generate, else call, else window.
    pub fn main_kind(&self) -> StepKind {
        [StepKind::Generate, StepKind::Call, StepKind::Window]
            .into_iter()
            .find(|&k| self.aggs[kind_index(k)].steps > 0)
            .unwrap_or(StepKind::Generate)
    }

    pub fn agg(&self, k: StepKind) -> &Agg {
        &self.aggs[kind_index(k)]
    }

    /// Events lost by the kernel side: the largest of the per-step sum and
    /// the cumulative totals of the latest health sample and of the end.
    pub fn lost(&self) -> u64 {
        self.lost_in_steps
            .max(self.health.as_ref().map_or(0, |h| h.lost_events))
            .max(self.end.as_ref().map_or(0, |e| e.lost_events))
    }

    /// Events dropped before drawing (consumer channel, or pause queue).
    pub fn dropped_total(&self) -> u64 {
        self.dropped + self.dropped_paused
    }

    pub fn ended(&self) -> bool {
        self.end.is_some()
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Set by the source: events it had to drop (never blocks the run).
    pub fn set_dropped(&mut self, n: u64) {
        if n != self.dropped {
            self.dropped = n;
            self.dirty = true;
        }
    }

    /// Set by the source when it has nothing more to give.
    pub fn set_source_done(&mut self) {
        if !self.source_done {
            self.source_done = true;
            self.dirty = true;
        }
    }

    /// Lines the target printed (its stdout/stderr are captured while the TUI is up).
    pub fn push_output(&mut self, line: String) {
        if self.output.len() >= MAX_OUTPUT_LINES {
            self.output.pop_front();
        }
        self.output.push_back(line);
        self.dirty = true;
    }

    pub fn set_viewport(&mut self, w: u16, h: u16) {
        if self.viewport != (w, h) {
            self.viewport = (w, h);
            self.dirty = true;
        }
    }

    /// Has anything changed since the last call (i.e. is a redraw needed)?
    pub fn take_dirty(&mut self) -> bool {
        std::mem::replace(&mut self.dirty, false)
    }

    /// Rows of a page in the current view (for PgUp/PgDn).
    pub fn page_rows(&self) -> usize {
        crate::view::body_rows(self.view, self.viewport.0, self.viewport.1).max(1)
    }

    /// Apply an input effect.
    pub fn apply(&mut self, e: Effect) -> Control {
        self.dirty = true;
        match e {
            Effect::Quit => return Control::Quit,
            Effect::SwitchView(v) => self.view = v,
            Effect::NextView => self.view = self.view.offset(1),
            Effect::PrevView => self.view = self.view.offset(-1),
            Effect::TogglePause => {
                self.paused = !self.paused;
                if !self.paused {
                    while let Some(ev) = self.pending.pop_front() {
                        self.apply_event(ev);
                    }
                }
            }
            Effect::Scroll(s) => self.scroll(s),
            Effect::NextHeatLayer => {
                self.heat.layer = match self.heat.layer {
                    HeatLayer::Residency => HeatLayer::Reads,
                    HeatLayer::Reads | HeatLayer::Refaults => HeatLayer::Residency,
                }
            }
            Effect::ToggleRefaultLayer => {
                self.heat.layer = match self.heat.layer {
                    HeatLayer::Refaults => HeatLayer::Residency,
                    HeatLayer::Residency | HeatLayer::Reads => HeatLayer::Refaults,
                }
            }
        }
        Control::Continue
    }

    fn scroll(&mut self, s: Scroll) {
        let page = self.page_rows();
        if self.view == View::Tokens {
            let max = self.rows.len().saturating_sub(page);
            let o = &mut self.tokens_offset;
            *o = match s {
                Scroll::Up(n) => o.saturating_add(n),
                Scroll::Down(n) => o.saturating_sub(n),
                Scroll::PageUp => o.saturating_add(page),
                Scroll::PageDown => o.saturating_sub(page),
                Scroll::Top => max,
                Scroll::Bottom => 0,
            }
            .min(max);
        } else {
            let o = &mut self.table_offset[self.view.index()];
            // Clamped by the view, which knows its length.
            *o = match s {
                Scroll::Up(n) => o.saturating_sub(n),
                Scroll::Down(n) => o.saturating_add(n),
                Scroll::PageUp => o.saturating_sub(page),
                Scroll::PageDown => o.saturating_add(page),
                Scroll::Top => 0,
                Scroll::Bottom => usize::MAX / 2,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use observer_common::model::{ExpertGrid, Residency, ThreadToken};

    fn token(seq: u64, kind: StepKind, wall_ms: u64) -> TokenRecord {
        let w = wall_ms * 1_000_000;
        TokenRecord {
            seq,
            index: Some(seq),
            kind,
            n_tokens: if kind == StepKind::Prompt { 10 } else { 1 },
            start_ns: seq * w,
            wall_ns: w,
            components: Components::from_kernel(&[w / 2, 0, w / 4, 0, 0, 0, 0, w / 8, w / 8, 0, 0]),
            residual_ns: 0,
            counters: Counters::default(),
            engine_compute_ns: Some(w * 3 / 4),
            threads: vec![ThreadToken {
                tid: 7,
                comm: "w".into(),
                components: Components::from_kernel(&[w, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]),
                counters: Counters::default(),
                residual_ns: 0,
            }],
            engine: None,
            residency: None,
            lost_events: 1,
            evicted_by: None,
            refaults: None,
            explicit_reads: None,
        }
    }

    #[test]
    fn rates_cover_generate_steps_only_and_unmeasured_stays_none() {
        let mut app = App::new();
        app.push(Event::Token(token(0, StepKind::Prompt, 1000)));
        for i in 1..=4 {
            app.push(Event::Token(token(i, StepKind::Generate, 100)));
        }
        app.refresh_stats();
        let r = app.rate.unwrap();
        assert!((r.rate - 10.0).abs() < 1e-9, "{r:?}");
        assert_eq!(app.rate_run(), Some(r.rate));
        assert_eq!(r.steps, 4);
        assert_eq!(app.main_kind(), StepKind::Generate);
        let g = app.agg(StepKind::Generate);
        assert_eq!(g.component(Component::Compute).mean(), Some(50e6));
        assert_eq!(g.hidden_ns.mean(), Some(25e6));
        assert_eq!(g.counter(Counter::Minflt).mean(), None, "not measured is None, not 0");
        assert_eq!(app.lost(), 5);
        assert_eq!(app.threads[&7].steps, 5);
    }

    #[test]
    fn the_decode_clock_counts_short_gaps_between_steps_but_not_idle_time() {
        let mut app = App::new();
        let step = |seq: u64, start_ms: u64, wall_ms: u64| {
            let mut t = token(seq, StepKind::Generate, wall_ms);
            t.start_ns = start_ms * 1_000_000;
            Event::Token(t)
        };
        app.push(step(0, 0, 90)); // next starts 10 ms after its end: cycle 100
        app.push(step(1, 100, 90)); // next starts 910 ms after its end (idle): cycle 90
        app.push(step(2, 1100, 90)); // the last: cycle = wall
        assert_eq!(app.rate_steps.iter().map(|s| s.1 / 1_000_000).collect::<Vec<_>>(), vec![100, 90, 90]);
        assert!((app.rate_run().unwrap() - 3.0 / 0.280).abs() < 1e-9);
        assert!((app.rate_in_steps().unwrap() - 3.0 / 0.270).abs() < 1e-9);
        // A prompt in between: no cycle spans it.
        app.push(Event::Token(token(3, StepKind::Prompt, 5)));
        app.push(step(4, 1200, 90));
        assert_eq!(app.rate_steps[2].1, 90_000_000);
        app.refresh_stats();
        assert!((app.rate.unwrap().rate - app.rate_run().unwrap()).abs() < 1e-9);
    }

    #[test]
    fn a_gap_longer_than_a_short_step_but_below_the_idle_floor_counts() {
        // 1 ms steps, the second preempted for 6 ms before its start, the third 101 ms idle.
        let mut app = App::new();
        let step = |seq: u64, start_us: u64| {
            let mut t = token(seq, StepKind::Generate, 1);
            t.start_ns = start_us * 1_000;
            Event::Token(t)
        };
        app.push(step(0, 0));
        app.push(step(1, 7_000));
        app.push(step(2, 8_000 + IDLE_GAP_NS / 1_000 + 1_000));
        assert_eq!(app.rate_steps.iter().map(|s| s.1 / 1_000).collect::<Vec<_>>(), vec![7_000, 1_000, 1_000]);
    }

    #[test]
    fn pause_queues_and_resume_applies_in_order() {
        let mut app = App::new();
        app.apply(Effect::TogglePause);
        for i in 0..3 {
            app.push(Event::Token(token(i, StepKind::Generate, 10)));
        }
        assert_eq!(app.rows.len(), 0);
        assert_eq!(app.pending(), 3);
        app.apply(Effect::TogglePause);
        assert_eq!(app.rows.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn histograms_and_health_are_kept_and_lost_events_take_the_largest_total() {
        let mut app = App::new();
        app.push(Event::Token(token(0, StepKind::Generate, 10)));
        app.push(Event::Health(ObserverHealth { lost_events: 4, probes_attached: 17, ..Default::default() }));
        let mut h = LatencyHistograms::default();
        h.kinds.insert("minflt".into(), vec![0, 1, 2]);
        app.push(Event::Histograms(h.clone()));
        assert_eq!(app.lost(), 4);
        assert_eq!(app.latency, Some(h));
        assert_eq!(app.health.as_ref().map(|h| h.probes_attached), Some(17));
    }

    #[test]
    fn end_switches_to_summary_once_and_views_cycle() {
        let mut app = App::new();
        app.push(Event::End(RunEnd { mono_ns: 1, exit_code: Some(0), lost_events: 9 }));
        assert_eq!(app.view, View::Summary);
        assert_eq!(app.lost(), 9);
        app.apply(Effect::NextView);
        assert_eq!(app.view, View::Heatmap);
        app.apply(Effect::PrevView);
        app.apply(Effect::PrevView);
        app.apply(Effect::PrevView);
        assert_eq!(app.view, View::Faults);
        assert_eq!(app.apply(Effect::Quit), Control::Quit);
    }

    #[test]
    fn scrolled_back_tokens_stay_put_and_clamp() {
        let mut app = App::new();
        app.set_viewport(80, 20);
        for i in 0..100 {
            app.push(Event::Token(token(i, StepKind::Generate, 10)));
        }
        app.apply(Effect::Scroll(Scroll::Up(5)));
        assert_eq!(app.tokens_offset, 5);
        app.push(Event::Token(token(100, StepKind::Generate, 10)));
        assert_eq!(app.tokens_offset, 6, "the same rows stay on screen");
        app.apply(Effect::Scroll(Scroll::Top));
        assert_eq!(app.tokens_offset, 101 - app.page_rows());
        app.apply(Effect::Scroll(Scroll::Up(1000)));
        assert_eq!(app.tokens_offset, 101 - app.page_rows());
        app.apply(Effect::Scroll(Scroll::Bottom));
        assert_eq!(app.tokens_offset, 0);
    }

    #[test]
    fn churn_is_remembered_for_a_window_of_steps() {
        let mut app = App::new();
        let grid = |added: Vec<u32>| ExpertGrid {
            n_layers: 1,
            n_experts: 3,
            layers: vec![0],
            resident: vec![1.0, 0.5, 0.0],
            added: Some(added),
            evicted: Some(vec![0, 0, 4]),
            read_bytes: None,
            read_calls: None,
            refault_faults: None,
            refault_io_ns: None,
        };
        let mut t = token(0, StepKind::Generate, 10);
        t.residency = Some(Residency { grid: Some(grid(vec![2, 0, 0])), ..Default::default() });
        app.push(Event::Token(t));
        assert_eq!(app.heat.churn(0), (true, false));
        assert_eq!(app.heat.churn(2), (false, true));
        assert_eq!((app.heat.step_added, app.heat.step_evicted), (Some(2), Some(4)));
        for s in 1..=CHURN_WINDOW {
            let mut t = token(s, StepKind::Generate, 10);
            t.residency = Some(Residency { grid: Some(grid(vec![0, 0, 0])), ..Default::default() });
            app.push(Event::Token(t));
        }
        assert_eq!(app.heat.churn(0), (false, false), "added churn aged out");
        assert_eq!(app.heat.churn(2), (false, true), "evictions went on");
        assert_eq!(app.heat.run_evicted, 4 * (CHURN_WINDOW + 1));
    }
}
