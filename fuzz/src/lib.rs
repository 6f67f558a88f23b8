//! Fuzzing of every parser of untrusted input.
//!
//! ## Spec
//! - A *target* ([`targets::TARGETS`]) is a function of a byte string that reads it the way a
//!   command reads a file or a request and goes on with what it read. An `Err` is a right answer;
//!   a panic, an abort, or one input running longer than [`HANG`] is a bug.
//! - *Seeds* of a target: the files in `fuzz/corpus/TARGET/` (committed: every input that once
//!   crashed, kept as a regression test) and the target's generated seeds (the engine's own GGUF
//!   writer, the repository's test data).
//! - Two engines run a target:
//!   - [`smoke`]: this crate's seeded mutation fuzzer, on stable Rust. It replays every seed,
//!     then runs a fixed number of inputs, each a seed changed by 1–8 stacked mutations
//!     ([`mutate`]) drawn from a xorshift generator started at a given seed. The same seed and
//!     count give the same inputs: `cargo xtask test` runs it (`fuzz/tests/smoke.rs`, the seed
//!     printed) and a failure is reproduced by `cargo xtask fuzz TARGET --mutate --seed S`.
//!   - libFuzzer, coverage guided (`src/bin/libfuzzer.rs`, built by `cargo xtask fuzz TARGET`
//!     with the sanitizer-coverage flags of stable rustc), without a bound.
//! - An input that fails is written to `target/fuzz/crashes/TARGET-HASH` and its path printed;
//!   the fix adds it to `fuzz/corpus/TARGET/`.

pub mod targets;

use std::{
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

pub use targets::{TARGETS, Target, names, target};

/// The longest one input may run before it counts as a hang (generous: the largest seeds parse
/// in milliseconds, and the machine may be loaded).
pub const HANG: Duration = Duration::from_secs(60);

/// Inputs never grow beyond this (the largest seed is a few tens of KiB).
pub const MAX_LEN: usize = 1 << 20;

/// A xorshift64* generator: small, fast, and the same sequence for the same seed everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // A zero state would stay zero.
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15 | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Values that break length and count checks.
const INTERESTING: [u64; 14] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 24,
    (1 << 32) + 1,
    i64::MAX as u64,
    u64::MAX,
];

/// Text that breaks number and field parsing.
const TOKENS: [&str; 16] = [
    "0",
    "-1",
    "NaN",
    "inf",
    "-inf",
    "1e308",
    "18446744073709551616",
    "",
    ",",
    "\n",
    "\"",
    "[",
    "{}",
    "null",
    "\r\n\r\n",
    "=",
];

/// Change `data` by 1–8 stacked mutations; `others` are inputs to splice from.
pub fn mutate(rng: &mut Rng, data: &mut Vec<u8>, others: &[Vec<u8>]) {
    for _ in 0..1 + rng.below(8) {
        let len = data.len();
        let at = |rng: &mut Rng| rng.below(len.max(1));
        match rng.below(12) {
            0 if len > 0 => {
                let i = at(rng);
                data[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = at(rng);
                data[i] = rng.next_u64() as u8;
            }
            2 if len > 0 => {
                // An integer of 1, 2, 4 or 8 bytes, little-endian (GGUF, traces) at any offset.
                let v = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                let w = [1, 2, 4, 8][rng.below(4)];
                let i = at(rng);
                let n = w.min(len - i);
                data[i..i + n].copy_from_slice(&v[..n]);
            }
            3 if len > 0 => {
                // Add or subtract a little (lengths off by a few).
                let i = at(rng);
                let d = 1 + rng.below(16) as u8;
                data[i] = if rng.below(2) == 0 { data[i].wrapping_add(d) } else { data[i].wrapping_sub(d) };
            }
            4 if len > 1 => {
                let i = at(rng);
                let n = 1 + rng.below((len - i).min(64));
                data.drain(i..i + n);
            }
            5 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                data.splice(i..i, bytes);
            }
            6 if len > 1 => {
                // Repeat a piece (duplicated records, rows, keys).
                let i = at(rng);
                let n = 1 + rng.below((len - i).min(256));
                let piece = data[i..i + n].to_vec();
                let j = rng.below(len + 1);
                data.splice(j..j, piece);
            }
            7 if len > 0 => {
                let i = at(rng);
                data.truncate(i);
            }
            8 if !others.is_empty() => {
                let o = &others[rng.below(others.len())];
                if !o.is_empty() {
                    let i = rng.below(o.len());
                    let n = 1 + rng.below((o.len() - i).min(512));
                    let j = rng.below(len + 1);
                    let end = if rng.below(2) == 0 { j } else { (j + n).min(len) };
                    data.splice(j..end, o[i..i + n].iter().copied());
                }
            }
            9 => {
                // Replace a number (or anything) in text with a hostile token.
                let t = TOKENS[rng.below(TOKENS.len())].as_bytes();
                let i = rng.below(len + 1);
                let mut end = i;
                while end < len && (data[end].is_ascii_digit() || b".-+eE".contains(&data[end])) {
                    end += 1;
                }
                data.splice(i..end, t.iter().copied());
            }
            10 if len > 1 => {
                // Copy a piece over another place of the same input.
                let i = at(rng);
                let n = 1 + rng.below((len - i).min(64));
                let j = rng.below(len - n + 1);
                data.copy_within(i..i + n, j);
            }
            _ => {
                let i = rng.below(len + 1);
                let b = [0u8, 0xff, b'\n', b',', b'"'][rng.below(5)];
                data.insert(i, b);
            }
        }
        data.truncate(MAX_LEN);
    }
}

/// A short name for an input's bytes (FNV-1a).
pub fn hash(data: &[u8]) -> String {
    let h = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    format!("{h:016x}")
}

/// `fuzz/` in the workspace's target directory (crashes, libFuzzer's working corpus).
pub fn work_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("fuzz"),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz"),
    }
}

/// The committed seeds of `t`: `fuzz/corpus/NAME/*`, sorted by name.
pub fn corpus(t: &Target) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(t.name);
    let Ok(rd) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut paths: Vec<PathBuf> = rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_file()).collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| (p.clone(), std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))))
        .collect()
}

/// Every seed of `t`: the committed corpus, then the generated seeds.
pub fn seeds(t: &Target) -> Vec<Vec<u8>> {
    let mut v: Vec<Vec<u8>> = corpus(t).into_iter().map(|(_, d)| d).collect();
    v.extend((t.seeds)());
    v
}

/// An input that made a target fail.
#[derive(Debug)]
pub struct Failure {
    pub target: &'static str,
    /// Which input: `seed N` or `mutation N of seed S`.
    pub input: String,
    pub message: String,
    pub saved: PathBuf,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fuzz target {}: {} panicked: {}; the input is in {} (replay: cargo xtask fuzz {} --replay {})",
            self.target,
            self.input,
            self.message,
            self.saved.display(),
            self.target,
            self.saved.display()
        )
    }
}

fn save(t: &Target, data: &[u8]) -> PathBuf {
    let dir = work_dir().join("crashes");
    let path = dir.join(format!("{}-{}", t.name, hash(data)));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, data)) {
        eprintln!("fuzz: cannot save the failing input to {}: {e}", path.display());
    }
    path
}

/// Runs `t` on one input; a panic becomes a [`Failure`] with the input saved.
pub fn run_one(t: &'static Target, data: &[u8], input: impl FnOnce() -> String) -> Result<(), Failure> {
    catch_unwind(AssertUnwindSafe(|| (t.run)(data))).map_err(|p| {
        let message = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        Failure { target: t.name, input: input(), message, saved: save(t, data) }
    })
}

/// Aborts the process (after saving the input) when one input runs longer than [`HANG`].
struct Watchdog {
    current: Arc<Mutex<(Instant, Vec<u8>, String)>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(t: &'static Target) -> Watchdog {
        let current = Arc::new(Mutex::new((Instant::now(), Vec::new(), String::new())));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (Arc::clone(&current), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let g = c.lock().unwrap_or_else(|e| e.into_inner());
                if g.0.elapsed() > HANG {
                    let saved = save(t, &g.1);
                    eprintln!(
                        "fuzz target {}: {} ran longer than {HANG:?} (a hang); the input is in {}",
                        t.name,
                        g.2,
                        saved.display()
                    );
                    std::process::abort();
                }
            }
        });
        Watchdog { current, stop, thread: Some(thread) }
    }

    fn arm(&self, data: &[u8], input: String) {
        let mut g = self.current.lock().unwrap_or_else(|e| e.into_inner());
        *g = (Instant::now(), data.to_vec(), input);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a [`smoke`] run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmokeStats {
    pub seeds: usize,
    pub mutations: u64,
}

/// Replays every seed of `t`, then `mutations` inputs mutated from them with `seed`
/// (`u64::MAX`: without end). Stops at the first failure.
pub fn smoke(t: &'static Target, seed: u64, mutations: u64) -> Result<SmokeStats, Failure> {
    let seeds = seeds(t);
    let dog = Watchdog::start(t);
    for (i, s) in seeds.iter().enumerate() {
        dog.arm(s, format!("seed {i}"));
        run_one(t, s, || format!("seed {i}"))?;
    }
    let mut rng = Rng::new(seed);
    let mut n = 0u64;
    while n < mutations {
        let mut data = if seeds.is_empty() { Vec::new() } else { seeds[rng.below(seeds.len())].clone() };
        mutate(&mut rng, &mut data, &seeds);
        let what = || format!("mutation {n} of seed {seed}");
        dog.arm(&data, what());
        run_one(t, &data, what)?;
        n += 1;
    }
    Ok(SmokeStats { seeds: seeds.len(), mutations: n })
}
