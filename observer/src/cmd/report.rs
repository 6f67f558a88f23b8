//! `observer report FILE`: one run (a trace or a bmoe_metrics CSV) summarised
//! through the same model stream and the same metrics as `diff`. For a trace
//! it first prints the end-of-run table `observer run` printed live (the same
//! function of the same stream: `observer::analysis::report`).

use std::path::PathBuf;

use anyhow::Result;
use observer::{
    analysis::{
        diff::{self, Options, est, utc},
        report::{self as run_report, Summary},
        stats::Estimate,
    },
    store::import::{self, LoadedRun},
};
use observer_common::model::Event;
use serde::Serialize;

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// A trace recorded by `observer record`, or a bmoe_metrics CSV.
    #[arg(value_name = "FILE")]
    pub input: PathBuf,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub bootstrap: super::diff::BootstrapArgs,
}

#[derive(Serialize)]
struct MetricRow {
    metric: String,
    label: &'static str,
    unit: &'static str,
    #[serde(flatten)]
    estimate: Estimate,
}

#[derive(Serialize)]
struct Report<'a> {
    source: String,
    format: import::Format,
    header: &'a observer_common::model::RunHeader,
    records: usize,
    prompt_steps: usize,
    tokens: usize,
    wall_cv: Option<f64>,
    exit_code: Option<i32>,
    /// Events the kernel side lost (from the end record, else summed over tokens).
    lost_events: u64,
    /// The recorder's counts; null when the trace has no end record.
    recorder: Option<observer::store::trace::RecorderStats>,
    notes: &'a [String],
    resampling: String,
    metrics: Vec<MetricRow>,
    /// The end-of-run summary (traces only), as `observer run --json` writes it.
    summary: Option<Summary>,
}

fn build<'a>(run: &'a LoadedRun, opts: &Options) -> Report<'a> {
    let ms = diff::metrics();
    let e = diff::estimate(&[run], &ms, opts, 0);
    let metrics = ms
        .iter()
        .zip(e)
        .filter(|(_, e)| e.n > 0)
        .map(|(m, estimate)| MetricRow { metric: m.key.clone(), label: m.label, unit: m.unit, estimate })
        .collect();
    Report {
        source: run.path.display().to_string(),
        format: run.format,
        header: &run.header,
        records: run.tokens.len(),
        prompt_steps: run.tokens.iter().filter(|t| t.kind == observer_common::model::StepKind::Prompt).count(),
        tokens: run.summarised().len(),
        wall_cv: diff::wall_cv(run),
        exit_code: run.end.as_ref().and_then(|e| e.exit_code),
        lost_events: run.lost_events() - run.recorder.map(|r| r.dropped()).unwrap_or(0),
        recorder: run.recorder,
        notes: &run.notes,
        resampling: opts.describe(),
        metrics,
        summary: (run.format == import::Format::Trace).then(|| {
            let (header, end) = (Event::Header(run.header.clone()), run.end.clone().map(Event::End));
            let tokens: Vec<Event> = run.tokens.iter().cloned().map(Event::Token).collect();
            run_report::summarise(std::iter::once(&header).chain(&tokens).chain(&run.other).chain(end.as_ref()))
        }),
    }
}

fn text(r: &Report<'_>) -> Result<String> {
    let h = r.header;
    let mut o = String::new();
    if let Some(s) = &r.summary {
        let mut table = Vec::new();
        s.print(&mut table)?;
        o.push_str(&String::from_utf8_lossy(&table));
        o.push('\n');
    }
    o.push_str(&format!(
        "{} ({}): {} records, {} prompt steps, {} tokens summarised\n",
        r.source, r.format, r.records, r.prompt_steps, r.tokens
    ));
    let mut fact = |k: &str, v: String| {
        if !v.is_empty() {
            o.push_str(&format!("  {k:<10} {v}\n"));
        }
    };
    fact("command", h.target_command.join(" "));
    fact("pid", if h.target_pid > 0 { h.target_pid.to_string() } else { String::new() });
    fact("started", if h.started_unix_ns > 0 { format!("{} UTC", utc(h.started_unix_ns)) } else { String::new() });
    fact("host", h.host.clone());
    fact("kernel", h.kernel.clone());
    fact("cpu", if h.cpu_model.is_empty() { String::new() } else { format!("{} ({} CPUs)", h.cpu_model, h.n_cpus) });
    fact(
        "memory",
        if h.mem_total_bytes > 0 {
            format!("{:.1} GiB", h.mem_total_bytes as f64 / (1u64 << 30) as f64)
        } else {
            String::new()
        },
    );
    fact("boot", h.boot_id.clone());
    fact(
        "observer",
        [h.observer_version.as_str(), h.mode.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(", "),
    );
    fact(
        "model",
        h.model.as_ref().map(|m| format!("{} ({} bytes, {})", m.path, m.size_bytes, m.hash)).unwrap_or_default(),
    );
    fact("config", h.engine_config.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
    fact("probes", if h.probes.is_empty() { String::new() } else { format!("{} attached", h.probes.len()) });
    fact("exit code", r.exit_code.map(|c| c.to_string()).unwrap_or_default());
    let dropped = match r.recorder {
        Some(s) if s.dropped() > 0 => format!(
            "\x1b[31m{} token and {} other events dropped by the recorder\x1b[0m",
            s.dropped_tokens, s.dropped_other
        ),
        Some(_) => "none dropped by the recorder".into(),
        None if r.format == import::Format::Trace => "recorder drops unknown (no end record)".into(),
        None => String::new(),
    };
    let lost = if r.lost_events > 0 {
        format!("\x1b[31mlost events: {}\x1b[0m", r.lost_events)
    } else {
        "lost events: 0".into()
    };
    o.push_str(&format!("  {lost}{}\n", if dropped.is_empty() { String::new() } else { format!("; {dropped}") }));
    for n in r.notes {
        o.push_str(&format!("  ! {n}\n"));
    }
    let labels: Vec<String> = r
        .metrics
        .iter()
        .map(|m| {
            if m.unit.is_empty() || m.unit == m.label {
                m.label.to_string()
            } else {
                format!("{} ({})", m.label, m.unit)
            }
        })
        .collect();
    let w = labels.iter().map(|l| l.chars().count()).max().unwrap_or(6);
    o.push_str(&format!("\n  {:<w$}  {:<32}  {:>6}\n", "metric", "mean [95 % CI]", "tokens"));
    for (m, l) in r.metrics.iter().zip(&labels) {
        o.push_str(&format!("  {:<w$}  {:<32}  {:>6}\n", l, est(&m.estimate), m.estimate.n));
    }
    if let Some(cv) = r.wall_cv {
        o.push_str(&format!("\n  per-token coefficient of variation of wall: {:.0} %", cv * 100.0));
        if r.tokens < diff::MIN_TOKENS {
            o.push_str(&format!(" — short run ({} tokens < {}): compare runs with care", r.tokens, diff::MIN_TOKENS));
        }
        o.push('\n');
    }
    o.push_str(&format!("  intervals: {}\n", r.resampling));
    Ok(o)
}

pub fn report(a: ReportArgs) -> Result<i32> {
    let opts = a.bootstrap.options(Vec::new())?;
    let run = import::load(&a.input)?;
    let r = build(&run, &opts);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", text(&r)?);
    }
    Ok(0)
}
