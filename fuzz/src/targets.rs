//! The fuzz targets: each reads a byte string the way a command reads a file or a request, and
//! goes on with what it read as far as that command would (summaries, plots, the model built
//! from a GGUF). Seeds are real inputs: the engine's own writer, the repository's test data.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

use engine::{
    gguf::Gguf,
    model::Model,
    regions::RegionMap,
    synth::{self, SynthConfig},
    tokenizer::Tokenizer,
};
use observer::{
    analysis::{attribution, report},
    capture::residency::direct::header_from_prefixes,
    plot::{
        self,
        cliff::{self, CliffBench, CliffPlot},
        tokens::TokenSeries,
    },
    sinks::prometheus::http,
    store::{
        import::{self, Format, LoadedRun, bmoe},
        trace,
    },
};
use observer_common::model::{Event, TokenRecord};

/// A fuzz target.
#[derive(Debug)]
pub struct Target {
    pub name: &'static str,
    /// What it reads, and who reads it that way.
    pub about: &'static str,
    /// Reads the input; an `Err` inside is a right answer, a panic or an abort is a bug.
    pub run: fn(&[u8]),
    /// Inputs to start from (besides `fuzz/corpus/NAME/`).
    pub seeds: fn() -> Vec<Vec<u8>>,
}

pub const TARGETS: &[Target] = &[
    Target {
        name: "gguf",
        about: "a GGUF header as `engine inspect` and the observer's residency map read it (metadata, tensor table, \
                region map)",
        run: gguf,
        seeds: gguf_seeds,
    },
    Target {
        name: "model",
        about: "a GGUF file as `engine run` loads it (hyperparameters, every weight's shape and type, placement, the \
                tokenizer from the vocabulary)",
        run: model,
        seeds: gguf_seeds,
    },
    Target {
        name: "trace",
        about: "an observer trace as `observer report/diff/export/plot` read it (records, damage, one run, summaries, \
                the per-token plot)",
        run: trace,
        seeds: trace_seeds,
    },
    Target {
        name: "bmoe",
        about: "a bmoe_metrics CSV as `observer report/diff/plot` import it",
        run: bmoe,
        seeds: bmoe_seeds,
    },
    Target {
        name: "config",
        about: "a `serve --config` TOML file (a stand-in flag table with each kind of flag `serve` has)",
        run: config,
        seeds: config_seeds,
    },
    Target {
        name: "bench-json",
        about: "a `bench cliff --json` result as `observer plot cliff` reads and draws it",
        run: bench_json,
        seeds: bench_json_seeds,
    },
    Target {
        name: "http",
        about: "an HTTP request head as the metrics endpoint parses it",
        run: http,
        seeds: http_seeds,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

/// The names of the targets, for messages.
pub fn names() -> String {
    TARGETS.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
}

/// The repository's root (seeds are read from its test data).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn files(dir: &Path, ext: &str) -> Vec<Vec<u8>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).collect()
}

fn gguf(data: &[u8]) {
    // The observer's header reader (prefixes grown as the parse asks) agrees with the whole file's parse.
    let path = Path::new("fuzz.gguf");
    let whole = Gguf::from_bytes(path, data.to_vec());
    let prefixes = header_from_prefixes(path, data.len() as u64, |n| Ok(Some(data[..n as usize].to_vec())));
    let table = |g: &Gguf| g.tensors.iter().map(|t| (t.name.clone(), t.offset, t.size)).collect::<Vec<_>>();
    match (&whole, &prefixes) {
        (Ok(w), Ok(Some(h))) => assert_eq!((table(w), &w.metadata), (table(h), &h.metadata), "header from prefixes"),
        (Err(_), Err(_)) => {}
        (w, h) => panic!(
            "the whole file's parse and the prefixes' disagree: {:?} vs {:?}",
            w.as_ref().err(),
            h.as_ref().err()
        ),
    }
    let Ok(g) = whole else { return };
    let _ = engine::inspect::report(&g, true);
    let Ok(map) = RegionMap::from_gguf(&g) else { return };
    let _ = g.get_u64(&format!("{}.expert_used_count", map.architecture));
    let _ = map.bytes_by_kind();
    for &layer in map.moe_layers.iter().take(4) {
        let _ = map.row_of(layer);
        for e in 0..map.n_experts.min(4) {
            let _ = map.expert_ranges(layer, e);
        }
    }
}

fn model(data: &[u8]) {
    let Ok(g) = Gguf::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    if let Ok(tok) = Tokenizer::from_gguf(&g)
        && let Ok(ids) = tok.encode("Hello, world")
    {
        let _ = tok.decode(&ids);
    }
    let _ = Model::from_gguf(g);
}

/// What every command does with a run it read: one run, its summaries, its per-token plot.
fn run(path: &Path, format: Format, events: Vec<Event>, mut notes: Vec<String>, key: fn(&TokenRecord) -> Option<u64>) {
    let events = import::one_run(path, events, &mut notes, key);
    let mut out = Vec::new();
    let _ = report::summarise(&events).print(&mut out);
    let run = LoadedRun::from_events(path, format, events);
    let _ = attribution::summarise(&run.tokens).print(&mut out);
    let series = TokenSeries::of(&run);
    if !series.is_empty() {
        let _ = plot::svg_string(&series);
    }
}

fn trace(data: &[u8]) {
    let path = Path::new("fuzz.trace");
    let Ok(mut r) = trace::Reader::new(data, path) else { return };
    let events: Vec<Event> = r.by_ref().collect();
    let notes = r.issues().iter().map(ToString::to_string).collect();
    let _ = (r.complete(), r.recorder(), r.records());
    run(path, Format::Trace, events, notes, |t| Some(t.seq));
}

fn bmoe(data: &[u8]) {
    let path = Path::new("bmoe-20260721-090406.csv");
    // The importer reads the file as UTF-8 text (`read_to_string`).
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok((events, notes)) = bmoe::parse(path, text) else { return };
    run(path, Format::BmoeMetrics, events, notes, |t| t.index);
}

/// A flag table with every kind of flag `serve` has: values, switches, aliases, repeated values.
fn config_command() -> &'static clap::Command {
    static CMD: OnceLock<clap::Command> = OnceLock::new();
    CMD.get_or_init(|| {
        use clap::{Arg, ArgAction};
        clap::Command::new("serve")
            .arg(Arg::new("metrics-addr").long("metrics-addr").visible_alias("web.listen-address"))
            .arg(Arg::new("name").long("name"))
            .arg(Arg::new("every").long("every"))
            .arg(Arg::new("discover").long("discover").action(ArgAction::SetTrue))
            .arg(Arg::new("token-symbol").long("token-symbol").action(ArgAction::Append))
            .arg(Arg::new("config").long("config"))
    })
}

fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let _ = observer::config::flags(config_command(), Path::new("serve.toml"), text, &["--name".to_string()]);
}

fn bench_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(b) = cliff::parse(Path::new("cliff.json"), text) else { return };
    let Ok(p) = CliffPlot::of(&[("cliff.json".to_string(), b)]) else { return };
    let _ = plot::svg_string(&p);
}

fn http(data: &[u8]) {
    // The endpoint reads the head as lossy UTF-8.
    let _ = http::parse_head(&String::from_utf8_lossy(data));
}

/// Tiny models of each architecture, written by the engine's own writer (tens of KiB each).
fn gguf_seeds() -> Vec<Vec<u8>> {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("a temporary directory");
            ["tiny", "olmoe-tiny", "qwen35moe-tiny", "gpt-oss-tiny"]
                .iter()
                .map(|name| {
                    let mut c = SynthConfig::preset(name).expect("a preset");
                    c.layers = c.layers.min(2).max(c.full_attn_interval.min(4));
                    c.hidden = 64;
                    c.heads = 2;
                    c.kv_heads = 2;
                    c.head_dim = 32;
                    c.experts = 4;
                    c.experts_used = 2;
                    c.expert_ffn = 32;
                    c.shared_ffn = c.shared_ffn.min(32);
                    c.rope_dims = c.rope_dims.min(16);
                    c.vocab = 300;
                    let path = dir.path().join(format!("{name}.gguf"));
                    synth::write_model(&c, &path, 1, |_| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
                    std::fs::read(&path).expect("the written model")
                })
                .collect()
        })
        .clone()
}

fn trace_seeds() -> Vec<Vec<u8>> {
    files(&repo().join("observer/tests/data"), "trace")
}

fn bmoe_seeds() -> Vec<Vec<u8>> {
    files(&repo().join("observer/tests/data"), "csv")
}

fn config_seeds() -> Vec<Vec<u8>> {
    let mut v = vec![std::fs::read(repo().join("packaging/serve.toml")).expect("packaging/serve.toml")];
    v.push(
        b"\"web.listen-address\" = \"0.0.0.0:9100\"\nname = \"engine\"\nevery = 5\ndiscover = true\n\
             token-symbol = [\"llama_decode\", \"llama_process\"]\n"
            .to_vec(),
    );
    v
}

fn bench_json_seeds() -> Vec<Vec<u8>> {
    let cell = |system: &str, round, limit_pct, tok_s| cliff::Cell {
        system: system.into(),
        round,
        limit_pct,
        tok_s,
        first_tok_s: Some(tok_s * 0.9),
        read_bytes_per_token: limit_pct.map(|l: f64| 1e6 * (100.0 - l)),
        hit_pct: Some(80.0),
        components_ms: Some([("compute".to_string(), 50.0), ("fault_io".to_string(), 20.0)].into()),
    };
    let b = CliffBench {
        format: cliff::FORMAT.into(),
        model: "/m/bench.gguf".into(),
        model_bytes: 5 << 30,
        cells: vec![
            cell("engine cache", 0, None, 17.5),
            cell("engine cache", 0, Some(60.0), 9.0),
            cell("engine cache", 1, Some(60.0), 8.5),
            cell("llama.cpp mmap", 0, Some(40.0), 0.4),
        ],
    };
    vec![serde_json::to_vec_pretty(&b).expect("serialisable")]
}

fn http_seeds() -> Vec<Vec<u8>> {
    [
        "GET /metrics HTTP/1.1\r\nHost: localhost:9977\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
        "GET /healthz?x=1#f HTTP/1.0\r\nUser-Agent: Prometheus/2.45\r\nAccept: text/plain\r\naccept: */*",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}
