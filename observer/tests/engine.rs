//! The embedded engine under the observer: a record for every token, the
//! components add up, and the fault counts agree with `perf stat` attached to
//! the same process for the same span.

mod common;

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use common::*;

fn state(pid: u32) -> char {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    s.rsplit_once(')').and_then(|(_, r)| r.trim().chars().next()).unwrap_or('?')
}

#[test]
fn engine_tokens_components_and_perf_stat() {
    let _l = machine_lock();
    let model = tiny_model();
    let dir = scratch_dir("engine");
    let (perf_out, json) = (dir.join("perf.csv"), dir.join("obs.json"));
    let _ = std::fs::remove_file(&json);
    let n_gen = 24;
    // A shell that stops itself, then becomes the engine (same PID): perf and
    // the observer attach while it is stopped, so both count the same span.
    let script = format!(
        "kill -STOP $$; exec {} run -m {} -p 'The quick brown fox' -n {n_gen} --ignore-eos --json -t 2",
        engine_bin().display(),
        model.display()
    );
    let target = Command::new("/bin/sh").args(["-c", &script]).stdout(Stdio::piped()).spawn().unwrap();
    let pid = target.id();
    for _ in 0..200 {
        if state(pid) == 'T' {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(state(pid), 'T', "the target did not stop itself");
    let mut perf = Command::new("perf")
        .args(["stat", "-x,", "-e", "major-faults,minor-faults", "-o"])
        .arg(&perf_out)
        .args(["-p", &pid.to_string()])
        .stderr(Stdio::null())
        .spawn()
        .expect("perf not found: run `cargo xtask setup`");
    let mut obs = Command::new(OBSERVER)
        .args(["run", "--follow-exec", "--every", "0", "--json", json.to_str().unwrap(), "--pid", &pid.to_string()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(obs.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.contains("probes attached"), "{first}");
    std::thread::sleep(Duration::from_millis(500)); // perf has no readiness signal
    // SAFETY: continuing our own stopped child.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let out = target.wait_with_output().unwrap();
    assert!(out.status.success(), "engine failed");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    assert!(obs.wait().unwrap().success(), "observer failed: {rest}");
    assert!(perf.wait().unwrap().success());
    assert!(rest.contains("engine markers attached"), "{rest}");

    let engine_out = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value =
        serde_json::from_str(engine_out.lines().rev().find(|l| l.contains("gen_tokens")).expect("engine summary"))
            .unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let toks = v["tokens"].as_array().unwrap();
    // One prompt step (which samples the first token), then one step per further token.
    let gen_tokens = u(&summary, "gen_tokens");
    assert_eq!(toks.len() as u64, gen_tokens, "a record for every marked step: {}", toks.len());
    assert_eq!(toks[0]["kind"], "prompt");
    assert!(toks[1..].iter().all(|t| t["kind"] == "generate"));
    let mut idx: Vec<u64> = toks.iter().map(|t| u(t, "index")).collect();
    idx.dedup();
    assert_eq!(idx.len(), toks.len(), "each token index once");
    // Per thread and token, the components add up to the wall time: checked
    // for threads that lived through the whole token (present in the previous
    // one too); a thread born during a token reports what is missing as its
    // residual instead.
    let mut prev: Vec<u64> = Vec::new();
    for t in toks {
        let wall = u(t, "wall_ns");
        let threads = t["threads"].as_array().unwrap();
        for th in threads.iter().filter(|th| prev.contains(&u(th, "tid"))) {
            let resid = th["residual_ns"].as_i64().unwrap();
            assert!(resid.unsigned_abs() <= wall / 50, "thread components vs wall: {th}");
        }
        prev = threads.iter().map(|th| u(th, "tid")).collect();
        // The engine's own numbers ride along.
        assert!(t["engine_compute_ns"].is_u64(), "{t}");
    }
    // Every record carries the engine's own step record (index and kind agree).
    for t in toks {
        assert!(t["engine"]["wall_ns"].is_u64(), "{t}");
    }
    let perf_text = std::fs::read_to_string(&perf_out).unwrap();
    let maj = perf_count(&perf_text, "major-faults");
    let min = perf_count(&perf_text, "minor-faults");
    assert!(min > 100, "{perf_text}");
    assert_within("minor faults vs perf stat", u(&v["totals"], "minflt"), min, 0.02);
    assert!(
        u(&v["totals"], "majflt").abs_diff(maj) <= maj / 50 + 2,
        "major faults {} vs perf {maj}",
        v["totals"]["majflt"]
    );
}

/// The engine's expert cache under `observer run`: the token records show which experts are in
/// the engine's cache (from its slot table) and the observer's hit rate. The version counter of
/// the last snapshot bounds the expert reads the cache made (2 for the table's publication + 4
/// per read, at most the misses the engine counts itself in its `--json` summary); the reads of
/// the intervals add up to the version counter's advance.
#[test]
fn engine_cache_slots_and_hit_rate_beside_the_engines() {
    let _l = machine_lock();
    let model = tiny_model();
    let json = scratch_dir("engine").join("cache.json");
    // Records read after the engine exited carry no residency sample (the process is gone), and
    // the whole run takes tens of milliseconds: read the ring every millisecond.
    let n_gen = 64;
    let out = Command::new(OBSERVER)
        .args(["run", "--every", "0", "--poll", "1ms", "--force", "--json", json.to_str().unwrap(), "--"])
        .arg(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "The quick brown fox", "-n", &n_gen.to_string()])
        .args(["--ignore-eos", "--json", "-t", "2", "--dense", "anon", "--experts", "cache", "--cache-mib", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "observer run failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value =
        serde_json::from_str(text.lines().rev().find(|l| l.contains("gen_tokens")).expect("engine summary")).unwrap();
    let cache = &summary["cache"];
    let (misses, n_slots) = (u(cache, "misses"), u(cache, "slots"));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let toks = v["tokens"].as_array().unwrap();
    let snaps: Vec<&serde_json::Value> =
        toks.iter().map(|t| &t["residency"]["engine_cache"]).filter(|c| c.is_object()).collect();
    assert!(snaps.len() >= 2, "{} of {} records show the cache", snaps.len(), toks.len());
    let (layers, experts) = (2u64, 8u64); // the tiny preset
    for c in &snaps {
        assert_eq!(u(c, "slots"), n_slots, "{c}");
        let ready: Vec<u64> = c["ready"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert!(ready.len() as u64 <= n_slots && ready.windows(2).all(|w| w[0] < w[1]), "{c}");
        assert!(ready.iter().all(|&cell| cell < layers * experts), "{c}");
        if let Some(h) = c["hit_pct"].as_f64() {
            assert!((0.0..=100.0).contains(&h), "{c}");
        }
    }
    let (first, last) = (snaps[0], snaps[snaps.len() - 1]);
    eprintln!("last version {}; engine: {misses} misses, {n_slots} slots", u(last, "version"));
    assert!(misses > 0, "a 1 MiB cache of the tiny model misses");
    // The last snapshot may precede the last tokens (the engine can exit before the observer's
    // last sample), so the version counter bounds the engine's reads from below.
    let version = u(last, "version");
    assert!(version > 2 && version <= 2 + 4 * misses, "version counter {version} vs the engine's {misses} misses");
    // Per interval, started = (Δseq / 2 + Δloading) / 2 (the module's rule), so over all of them
    // 4 · reads = the counter's advance + 2 · (reads in flight at the last − at the first).
    let reads: u64 = snaps[1..].iter().map(|c| c["reads"].as_u64().expect("reads after the first snapshot")).sum();
    let advance = (u(last, "version") - u(first, "version")) as i64;
    let in_flight = u(last, "loading") as i64 - u(first, "loading") as i64;
    assert_eq!(
        4 * reads as i64,
        advance + 2 * in_flight,
        "reads of the intervals {reads} vs the version counter's advance {advance} and reads in flight {in_flight}"
    );
    assert!(snaps.iter().any(|c| c["hit_pct"].is_number()), "a hit rate for generated tokens");
}

/// The expert grid's rows carry their layers (block indices), and per layer the experts the
/// observer sees ready in the engine's cache are exactly those the engine's router chose, by the
/// engine's own routing counts (`expert_counts` of its `--json` summary) on the same run.
///
/// The engine runs the prompt step only, with a cache that holds every expert (so nothing is
/// evicted and every chosen expert is read once into a slot). Its stdout is a pipe the test has
/// filled but for a few hundred bytes: the step's token line fits, the summary after the step
/// does not, so the engine waits there with its slot table still published until the observer's
/// line for the step shows that the step's record, and its residency sample, are done. Then the
/// test drains the pipe and the engine finishes. No clock decides anything.
#[test]
fn grid_rows_carry_their_layers_and_the_cache_holds_what_the_engine_routed() {
    use std::io::{Read, Write};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let _l = machine_lock();
    // 4 layers of 32 experts, 2 chosen per token: a short prompt leaves most of each layer unused.
    let model = synth_model("grid-layers.gguf", &["--layers", "4", "--experts", "32", "--experts-used", "2"]);
    let json = scratch_dir("engine").join("grid-layers.json");

    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0, "pipe2");
    // SAFETY: fresh descriptors of ours.
    let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fcntl on our descriptor.
    let cap = unsafe { libc::fcntl(write_end.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    assert!(cap >= 4096, "F_SETPIPE_SZ: {}", std::io::Error::last_os_error());
    let room = 256;
    std::fs::File::from(write_end.try_clone().unwrap()).write_all(&vec![b'#'; cap as usize - room]).unwrap();

    let mut obs = Command::new(OBSERVER)
        .args(["run", "--every", "1", "--poll", "1ms", "--residency-interval", "1ms", "--force", "--json"])
        .arg(&json)
        .arg("--")
        .arg(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "Hello", "-n", "1", "--json", "-t", "1"])
        .args(["--experts", "cache", "--cache-mib", "64"])
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::piped())
        .spawn()
        .expect("observer");
    let (tx, rx) = std::sync::mpsc::channel();
    let err = obs.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut seen = String::new();
        for line in BufReader::new(err).lines() {
            let line = line.unwrap_or_default();
            seen.push_str(&line);
            seen.push('\n');
            // The observer's line of step 0 (`attribution::line`: the index, then the kind).
            if line.split_whitespace().next() == Some("0") && line.contains('|') {
                let _ = tx.send(());
            }
        }
        seen
    });
    // A guard against a hang, not a measurement: the engine cannot finish before the pipe drains.
    let step_done = rx.recv_timeout(Duration::from_secs(300));
    let mut out = Vec::new();
    std::fs::File::from(read_end).read_to_end(&mut out).unwrap();
    let status = obs.wait().unwrap();
    let seen = reader.join().unwrap();
    assert!(step_done.is_ok(), "no observer line for the prompt step:\n{seen}");
    assert!(status.success(), "observer run failed: {status}\n{seen}");

    let out = String::from_utf8_lossy(&out);
    let summary: serde_json::Value = serde_json::from_str(
        out.trim_start_matches('#').lines().find(|l| l.contains("expert_counts")).expect("the engine's summary"),
    )
    .unwrap();
    let counts: Vec<Vec<u64>> = serde_json::from_value(summary["expert_counts"].clone()).unwrap();
    let k = 2;
    let prompt_tokens = u(&summary, "prompt_tokens");
    for (layer, c) in counts.iter().enumerate() {
        assert_eq!(c.iter().sum::<u64>(), prompt_tokens * k, "layer {layer}: {k} experts per prompt token");
    }

    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let toks = v["tokens"].as_array().unwrap();
    assert_eq!(toks.len(), 1, "one step, the prompt");
    let r = &toks[0]["residency"];
    let (grid, cache) = (&r["grid"], &r["engine_cache"]);
    let layers: Vec<u64> = serde_json::from_value(grid["layers"].clone()).expect("the grid's layers");
    assert_eq!(layers, (0..counts.len() as u64).collect::<Vec<_>>(), "every block of the model has routed experts");
    assert_eq!(u(grid, "n_layers"), layers.len() as u64);
    let ne = u(grid, "n_experts");
    assert_eq!(ne, 32);
    assert!(u(cache, "slots") >= layers.len() as u64 * ne, "a cache of every expert: {cache}");
    assert_eq!(u(cache, "loading"), 0, "the step's reads are done: {cache}");
    let ready: Vec<u64> = serde_json::from_value(cache["ready"].clone()).unwrap();
    let used = |c: &Vec<u64>| c.iter().map(|&n| n > 0).collect::<Vec<_>>();
    assert!(
        counts.iter().any(|c| used(c) != used(&counts[0])),
        "the layers route differently, so rows cannot be swapped unseen"
    );
    for (row, &layer) in layers.iter().enumerate() {
        let observed: Vec<u64> = ready.iter().filter(|&&c| c / ne == row as u64).map(|&c| c % ne).collect();
        let routed: Vec<u64> = (0..ne).filter(|&e| counts[layer as usize][e as usize] > 0).collect();
        eprintln!("layer {layer}: observer {} experts ready, engine routed to {}", observed.len(), routed.len());
        assert!(!routed.is_empty() && routed.len() < ne as usize, "layer {layer}: {routed:?}");
        assert_eq!(
            observed, routed,
            "layer {layer} (grid row {row}): ready in the cache vs the engine's routing counts"
        );
    }
}

/// The engine's expert cache under the observer: the decode thread's waits for the I/O workers'
/// `O_DIRECT` reads are `io_wait_peer`, against the engine's own `stall` (its clock around those
/// waits) on the same tokens; the workers' reads are their `io_wait`; the components still add up.
#[test]
fn cache_stalls_are_io_wait_peer_beside_the_engines_stall() {
    let _l = machine_lock();
    let model = tiny_model();
    let json = scratch_dir("engine").join("cache-stall.json");
    let out = Command::new(OBSERVER)
        .args(["run", "--every", "0", "--force", "--json", json.to_str().unwrap(), "--"])
        .arg(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "The quick brown fox", "-n", "64"])
        .args(["--ignore-eos", "-t", "2", "--dense", "anon", "--experts", "cache", "--cache-mib", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "observer run failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let toks: Vec<&serde_json::Value> =
        v["tokens"].as_array().unwrap().iter().filter(|t| t["engine"]["stall_ns"].is_u64()).collect();
    assert!(toks.len() >= 60, "{} records with the engine's stall", toks.len());
    let ns = |th: &serde_json::Value, c: &str| th[format!("{c}_ns")].as_u64().unwrap_or_else(|| panic!("{c} in {th}"));
    let (mut stall, mut peer, mut rq, mut sys, mut io_wait) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for t in &toks {
        let wall = u(t, "wall_ns");
        let threads = t["threads"].as_array().unwrap();
        let sum = |th: &serde_json::Value| -> u64 {
            observer_common::vocab::Component::measured().map(|c| ns(th, c.name())).sum()
        };
        // A thread started during the token (the I/O workers, at the first) has less.
        for th in threads {
            assert!(sum(th) <= wall + wall / 50 + 1000, "components {} vs wall {wall}: {th}", sum(th));
        }
        let main =
            threads.iter().find(|th| th["comm"] == "engine").unwrap_or_else(|| panic!("no engine thread in {t}"));
        assert!(
            wall.abs_diff(sum(main)) <= wall / 50 + 1000,
            "decode thread's components {} vs wall {wall}: {main}",
            sum(main)
        );
        stall += u(&t["engine"], "stall_ns");
        peer += ns(main, "io_wait_peer");
        rq += ns(main, "runqueue");
        sys += ns(main, "syscall");
        io_wait += threads
            .iter()
            .filter(|th| th["comm"].as_str().is_some_and(|c| c.starts_with("engine-io")))
            .map(|th| ns(th, "io_wait"))
            .sum::<u64>();
    }
    eprintln!(
        "stall {stall} ns, decode thread io_wait_peer {peer}, runqueue {rq}, syscall {sys}; I/O workers' io_wait {io_wait}"
    );
    assert!(stall > 0 && io_wait > 0, "a 1 MiB cache of the tiny model reads and waits");
    // Every io_wait_peer of the decode thread is inside its stalls (up to its waits on the queue's
    // lock while a worker that just read holds it), ...
    assert!(peer <= stall + stall / 20 + 1_000_000, "io_wait_peer {peer} vs the engine's stall {stall}");
    // ... and a stall is that wait, the run-queue wait after the wakeup and the futex calls' CPU time.
    assert!(
        peer + rq + sys >= stall - stall / 10,
        "io_wait_peer {peer} + runqueue {rq} + syscall {sys} vs stall {stall}"
    );
}

/// Explicit reads per region (`observer_common::xread`): the expert cache's `O_DIRECT` `pread64`s
/// of the model, per token, against three sources on the same run: the engine's own `read_bytes`
/// (its clock around the same calls), a bpftrace count of the engine's `pread64` returns between
/// its token markers (the kernel's), and the experts the engine logged as loaded (`--cache-log`).
/// The interval index is held to 16 buckets (`MOE_OBSERVER_INDEX_BUCKETS`), so that each read's
/// interval takes the search steps of a large model's (the default index of this small one needs
/// none: `per_expert_explicit_reads_fill_the_grid_the_trace_and_the_heatmap` runs that). The
/// churn of the same run goes through the same index and steps: `residency.rs` holds it to
/// `mincore`.
#[test]
fn cache_reads_are_charged_per_region_to_the_experts_the_engine_loaded() {
    let _l = machine_lock();
    let model = tiny_model();
    let dir = scratch_dir("engine");
    let json = dir.join("xread.json");
    let log = dir.join("xread-loads.txt");
    let _ = std::fs::remove_file(&log);
    let engine = engine_bin();
    let bt = Bpftrace::start(&format!(
        "uprobe:{e}:moe_engine_token_begin {{ @tok[pid] = arg0; @in[pid] = 1; }} \
         uprobe:{e}:moe_engine_token_end {{ @in[pid] = 0; }} \
         tracepoint:syscalls:sys_exit_pread64 /@in[pid] == 1 && args->ret > 0/ \
         {{ @bytes[pid, @tok[pid], strncmp(comm, \"engine-io\", 9) == 0 ? 1 : 0] = sum(args->ret); }}",
        e = engine.display()
    ));
    let out = Command::new(OBSERVER)
        .env("MOE_OBSERVER_INDEX_BUCKETS", "16")
        .args(["run", "--every", "0", "--force", "--json", json.to_str().unwrap(), "--"])
        .arg(&engine)
        .args(["run", "-m", model.to_str().unwrap(), "-p", "The quick brown fox", "-n", "48"])
        .args(["--ignore-eos", "-t", "2", "--dense", "anon", "--experts", "cache", "--cache-mib", "1"])
        .args(["--cache-log", log.to_str().unwrap()])
        .output()
        .unwrap();
    let text = bt.finish();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "observer run failed: {stderr}");
    let span: u32 = stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("observer: the interval index has 16 buckets ")?.rsplit_once("span ")?.1.parse().ok()
        })
        .unwrap_or_else(|| panic!("no line on the interval index: {stderr}"));
    assert!(span >= 4, "16 buckets of the tiny model: each covers several intervals, span {span}");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let pid = v["target"]["pid"].as_u64().unwrap_or_else(|| panic!("no target pid: {}", v["target"]));
    // bpftrace: pread64 bytes per token index of this engine process, of its I/O workers (the
    // cache's reads of the model) and of its other threads (the telemetry's reads of /proc files:
    // other descriptors, which must not be charged to the model).
    let (mut kernel, mut other_fds) = (std::collections::BTreeMap::<u64, u64>::new(), 0u64);
    for (k, b) in bpftrace_map(&text, "bytes") {
        let f: Vec<u64> = k.split(", ").map(|x| x.parse().unwrap()).collect();
        if f[0] != pid {
            continue;
        }
        if f[2] == 1 {
            kernel.insert(f[1], b);
        } else {
            other_fds += b;
        }
    }
    // The engine's log: the experts it started reading, per step.
    let mut loaded: std::collections::BTreeMap<u64, std::collections::BTreeSet<(u64, u64)>> = Default::default();
    for l in std::fs::read_to_string(&log).unwrap().lines() {
        let f: Vec<u64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
        loaded.entry(f[0]).or_default().insert((f[1], f[2]));
    }
    let toks: Vec<&serde_json::Value> = v["tokens"].as_array().unwrap().iter().collect();
    assert!(toks.len() >= 45, "{} token records", toks.len());
    let (mut checked, mut with_reads, mut unresolved_tokens) = (0, 0, 0);
    for (i, t) in toks.iter().enumerate() {
        let x = &t["explicit_reads"];
        assert!(x.is_object(), "no explicit_reads in {t}");
        let idx = u(t, "index");
        let unresolved = u(x, "unresolved_bytes");
        // A descriptor is resolved by user space after the kernel asks (at its open); reads before
        // the answer are unresolved, never charged to a region. Every step preads the same
        // descriptors (the engine's telemetry, its cache's model fd), so once answered they stay
        // answered: only a run of first steps can have unresolved reads (how many depends on how
        // soon the observer runs after the open: 3 steps of this tiny model on a loaded CI
        // machine).
        if unresolved > 0 {
            assert_eq!(unresolved_tokens, i, "unresolved reads at step {idx} after resolved steps: {x}");
            unresolved_tokens += 1;
            continue;
        }
        let (dense, experts, other) = (u(&x["bytes"], "dense"), u(&x["bytes"], "experts"), u(&x["bytes"], "other"));
        let engine_bytes = u(&t["engine"], "read_bytes");
        // The cache reads routed experts only.
        assert_eq!((dense, other), (0, 0), "step {idx}: {x}");
        // No other thread's preads (other descriptors) are in them: they equal the workers'.
        assert_eq!(experts, engine_bytes, "step {idx}: observer's expert bytes vs the engine's read_bytes: {x}");
        assert_eq!(
            experts,
            kernel.get(&idx).copied().unwrap_or(0),
            "step {idx}: observer's expert bytes vs bpftrace's pread64 returns"
        );
        // Per expert: the records add up to the kind's bytes, and name the experts the engine loaded.
        let per_expert: Vec<&serde_json::Value> = x["experts"].as_array().unwrap().iter().collect();
        let sum: u64 = per_expert.iter().map(|e| u(e, "bytes")).sum();
        let lost = u(x, "lost_bytes");
        assert_eq!(sum + lost, experts, "step {idx}: Σ per-expert bytes + lost vs experts bytes: {x}");
        assert_eq!(lost, 0, "step {idx}: per-expert records lost: {x}");
        let seen: std::collections::BTreeSet<(u64, u64)> =
            per_expert.iter().map(|e| (u(e, "layer"), u(e, "expert"))).collect();
        assert_eq!(seen, loaded.get(&idx).cloned().unwrap_or_default(), "step {idx}: experts read vs loaded");
        // Every expert listed was read.
        for e in &per_expert {
            assert!(u(e, "bytes") > 0, "{e}");
        }
        // The time inside the calls was measured where there were calls.
        assert_eq!(u(&x["calls"], "experts") > 0, experts > 0, "{x}");
        assert_eq!(u(&x["ns"], "experts") > 0, experts > 0, "{x}");
        checked += 1;
        with_reads += (experts > 0) as u32;
    }
    eprintln!(
        "{checked} steps checked, {with_reads} with expert reads, {unresolved_tokens} with unresolved reads; \
         bpftrace steps {}, other descriptors' pread64 bytes {other_fds}",
        kernel.len()
    );
    assert!(unresolved_tokens <= toks.len() / 4, "{unresolved_tokens} of {} steps with unresolved reads", toks.len());
    assert_eq!(checked, toks.len() - unresolved_tokens);
    assert!(with_reads >= 10, "a 1 MiB cache of the tiny model misses on most steps: {with_reads}");
    // The same process read other files with pread64 during the steps, and none of it was charged.
    assert!(other_fds > 0, "the engine's telemetry preads /proc files during its steps");
}

/// bpftrace, started before a run: the bytes and calls of the `pread64`s that returned data on a
/// descriptor its process opened `model` with (`openat` of that path; `close` forgets it), per
/// process. An independent count of the explicit reads of the model by any of its threads.
fn model_preads(model: &std::path::Path) -> Bpftrace {
    let path = model.to_str().unwrap();
    // bpftrace compares at most BPFTRACE_STRLEN bytes of a string.
    assert!(path.len() < 200 && !path.contains('"'), "a model path bpftrace can compare: {path}");
    Bpftrace::start_env(
        &format!(
            "tracepoint:syscalls:sys_enter_openat /str(args->filename) == \"{path}\"/ {{ @opening[tid] = 1; }} \
             tracepoint:syscalls:sys_exit_openat /@opening[tid] == 1/ \
             {{ delete(@opening[tid]); if (args->ret >= 0) {{ @model[pid, (uint64)args->ret] = 1; }} }} \
             tracepoint:syscalls:sys_enter_close /@model[pid, (uint64)args->fd] == 1/ \
             {{ delete(@model[pid, (uint64)args->fd]); }} \
             tracepoint:syscalls:sys_enter_pread64 /@model[pid, (uint64)args->fd] == 1/ {{ @inread[tid] = 1; }} \
             tracepoint:syscalls:sys_exit_pread64 /@inread[tid] == 1/ \
             {{ delete(@inread[tid]); if (args->ret > 0) {{ @bytes[pid] = sum(args->ret); @calls[pid] = count(); }} }}"
        ),
        &[("BPFTRACE_STRLEN", "200")],
    )
}

/// `model_preads`' (bytes, calls) of process `pid`.
fn model_pread_totals(text: &str, pid: u64) -> (u64, u64) {
    let of = |name: &str| bpftrace_map(text, name).into_iter().find(|(k, _)| k == &pid.to_string()).map_or(0, |x| x.1);
    (of("bytes"), of("calls"))
}

type PerExpert = std::collections::BTreeMap<(u64, u64), u64>;

/// The engine's `--cache-log`: per step, the bytes of each expert it started reading.
fn cache_log(path: &std::path::Path) -> std::collections::BTreeMap<u64, PerExpert> {
    let mut steps: std::collections::BTreeMap<u64, PerExpert> = Default::default();
    for l in std::fs::read_to_string(path).unwrap().lines() {
        let f: Vec<u64> = l.split(' ').map(|x| x.parse().unwrap_or_else(|_| panic!("cache log line {l:?}"))).collect();
        assert_eq!(f.len(), 4, "STEP LAYER EXPERT BYTES: {l:?}");
        *steps.entry(f[0]).or_default().entry((f[1], f[2])).or_default() += f[3];
    }
    steps
}

/// The per-expert reads of records (`explicit_reads.experts`), summed.
fn records_per_expert<'a>(records: impl IntoIterator<Item = &'a serde_json::Value>) -> PerExpert {
    let mut m = PerExpert::new();
    for t in records {
        for e in t["explicit_reads"]["experts"].as_array().unwrap() {
            *m.entry((u(e, "layer"), u(e, "expert"))).or_default() += u(e, "bytes");
        }
    }
    m
}

/// The run's per-expert reads against the cache log's: no expert above the log, none the engine
/// did not read; returns the bytes missing in all (reads made before the observer had identified
/// the descriptor they were made on: `unresolved_bytes`, charged to no expert).
fn shortfall_against_the_log(seen: &PerExpert, log: &PerExpert, what: &str) -> u64 {
    let mut short = 0;
    for (k, &want) in log {
        let got = seen.get(k).copied().unwrap_or(0);
        assert!(got <= want, "{what}: expert {k:?}: {got} bytes seen, the engine read {want}");
        short += want - got;
    }
    for (k, &got) in seen {
        assert!(log.contains_key(k) || got == 0, "{what}: expert {k:?} ({got} bytes) was never read by the engine");
    }
    short
}

/// The model bytes bpftrace saw and the observer charged to no region lie within the unresolved
/// bytes (which may also hold reads of other files: a descriptor is unresolved until identified).
fn assert_uncharged_within_unresolved(charged: u64, bt: u64, unresolved: u64, what: &str) {
    assert!(
        charged <= bt && bt <= charged + unresolved,
        "{what}: charged {charged}, bpftrace {bt}, unresolved {unresolved}"
    );
}

/// `observer heatmap --trace TRACE --json` (and `extra` arguments): its JSON lines.
fn heatmap_json(trace: &std::path::Path, extra: &[&str]) -> Vec<serde_json::Value> {
    let o = Command::new(OBSERVER)
        .args(["heatmap", "--trace", trace.to_str().unwrap(), "--json"])
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "observer heatmap --trace: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The per-expert bytes of `observer heatmap --trace --json`.
fn listed_per_expert(v: &serde_json::Value) -> PerExpert {
    v["experts"].as_array().unwrap().iter().map(|e| ((u(e, "layer"), u(e, "expert")), u(e, "read_bytes"))).collect()
}

/// While `rec` (`observer record -o trace` of the engine with `--cache-log log`) runs: for each of
/// `steps`, stop the engine (SIGSTOP) once it reads experts for that step, and let it go on once
/// the trace holds the steps before it. Each pause ends a batch of token records (so a grid),
/// whatever the engine's speed. During each pause, `observer heatmap --trace` (which reads the
/// trace being written) lists per expert what the cache log says the engine read in the steps
/// the trace holds; at the first pause an `observer heatmap --trace --watch` is started, returned.
fn pause_at_steps(
    rec: &mut std::process::Child,
    log: &std::path::Path,
    trace: &std::path::Path,
    steps: &[u64],
) -> Watch {
    /// Lets the engine go on (and stops the recorder) if the test fails while it is stopped.
    struct Resume(u32, u32, bool);
    impl Drop for Resume {
        fn drop(&mut self) {
            if self.2 {
                // SAFETY: kill(2) of the engine and the recorder this test started.
                unsafe {
                    libc::kill(self.0 as i32, libc::SIGCONT);
                    libc::kill(self.1 as i32, libc::SIGKILL);
                }
            }
        }
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let logged_step = || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        text.lines().filter_map(|l| l.split(' ').next()?.parse::<u64>().ok()).max()
    };
    let mut watch = None;
    for &step in steps {
        while logged_step().is_none_or(|s| s < step) {
            assert!(std::time::Instant::now() < deadline, "the engine read no expert for step {step} in 120 s");
            assert!(rec.try_wait().unwrap().is_none(), "observer record ended before step {step} read an expert");
            std::thread::sleep(Duration::from_millis(2));
        }
        let engine = child_named(rec.id(), "engine").expect("the engine, a child of observer record");
        let resume = Resume(engine, rec.id(), true);
        // SAFETY: kill(2) of the engine this test started (through the observer).
        unsafe { libc::kill(engine as i32, libc::SIGSTOP) };
        // The observer drains and writes the steps that ended; wait for them in the trace.
        let live = loop {
            let v = heatmap_json(trace, &[]).pop().unwrap();
            if v["last_index"].as_u64().is_some_and(|i| i + 1 >= step) {
                break v;
            }
            assert!(std::time::Instant::now() < deadline, "step {} not in the trace: {v}", step - 1);
            std::thread::sleep(Duration::from_millis(20));
        };
        let last = u(&live, "last_index");
        assert_eq!((&live["ended"], u(&live, "target_pid")), (&serde_json::json!(false), u64::from(engine)), "{live}");
        let upto =
            cache_log(log).range(..=last).flat_map(|(_, m)| m.clone()).fold(PerExpert::new(), |mut m, (k, b)| {
                *m.entry(k).or_default() += b;
                m
            });
        let short = shortfall_against_the_log(&listed_per_expert(&live), &upto, &format!("live, through step {last}"));
        assert!(short <= u(&live, "unresolved_bytes"), "live: {short} bytes missing, more than unresolved: {live}");
        if watch.is_none() {
            let mut w = Command::new(OBSERVER)
                .args(["heatmap", "--trace", trace.to_str().unwrap(), "--json", "--watch", "--interval", "50ms"])
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            // Its first refresh, while the engine is stopped: the trace has not ended.
            let mut first = String::new();
            let mut out = BufReader::new(w.stdout.take().unwrap());
            out.read_line(&mut first).unwrap();
            let first: serde_json::Value = serde_json::from_str(&first).unwrap();
            assert_eq!(first["ended"], false, "{first}");
            // The rest, read by a thread so that the pipe never fills.
            let rest = std::thread::spawn(move || {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut out, &mut s).unwrap();
                s
            });
            watch = Some((w, first, rest));
        }
        let mut resume = resume;
        resume.2 = false;
        // SAFETY: as above.
        unsafe { libc::kill(engine as i32, libc::SIGCONT) };
    }
    let (child, first, rest) = watch.unwrap();
    Watch { child, first, rest }
}

/// An `observer heatmap --trace --watch --json` started during a run: its first refresh, and the
/// rest of its output.
struct Watch {
    child: std::process::Child,
    first: serde_json::Value,
    rest: std::thread::JoinHandle<String>,
}

impl Watch {
    /// Every refresh, once it exits (at the trace's end record).
    fn refreshes(mut self) -> Vec<serde_json::Value> {
        let st = self.child.wait().unwrap();
        assert!(st.success(), "observer heatmap --watch: {st}");
        let rest = self.rest.join().unwrap();
        std::iter::once(self.first).chain(rest.lines().map(|l| serde_json::from_str(l).unwrap())).collect()
    }
}

/// The per-expert explicit reads are wherever the per-expert residency is: the grid's
/// `read_bytes` / `read_calls` layers of the token records, the trace, and `observer heatmap
/// --trace`. Per grid, each expert's bytes equal what the engine's cache log says it read of that
/// expert in the steps since the previous grid; over the run, the bytes add up to a bpftrace sum
/// of `pread64` returns on the model's descriptors (same run).
#[test]
fn per_expert_explicit_reads_fill_the_grid_the_trace_and_the_heatmap() {
    let _l = machine_lock();
    let model = tiny_model();
    let dir = scratch_dir("engine-xgrid");
    let (trace, json, log) = (dir.join("run.trace"), dir.join("run.json"), dir.join("loads.txt"));
    for f in [&trace, &json, &log] {
        let _ = std::fs::remove_file(f);
    }
    for f in std::fs::read_dir(&dir).unwrap().flatten() {
        if f.file_name().to_string_lossy().starts_with("run.trace.partial-") {
            let _ = std::fs::remove_file(f.path()); // left by a killed recorder
        }
    }
    let bt = model_preads(&model);
    let mut rec = Command::new(OBSERVER)
        .args(["record", "-o", trace.to_str().unwrap(), "--json", json.to_str().unwrap(), "--every", "0", "--force"])
        .arg("--")
        .arg(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "The quick brown fox", "-n", "48"])
        .args(["--ignore-eos", "-t", "2", "--dense", "anon", "--experts", "cache", "--cache-mib", "1"])
        .args(["--cache-log", log.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let watch = pause_at_steps(&mut rec, &log, &trace, &[4, 12, 24, 36]);
    let out = rec.wait_with_output().unwrap();
    let text = bt.finish();
    assert!(out.status.success(), "observer record failed: {}", String::from_utf8_lossy(&out.stderr));
    // `--watch`, started while the engine was stopped, followed the trace to its end record.
    let refreshes = watch.refreshes();
    assert_eq!(refreshes[0]["ended"], false, "{}", refreshes[0]);
    assert_eq!(refreshes.last().unwrap()["ended"], true, "--watch stops at the end record");
    assert!(refreshes.windows(2).all(|w| u(&w[1], "records") >= u(&w[0], "records")), "refreshes never go back");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let pid = u(&v["target"], "pid");
    let (bt_bytes, bt_calls) = model_pread_totals(&text, pid);
    let log = cache_log(&log);
    let toks: Vec<&serde_json::Value> = v["tokens"].as_array().unwrap().iter().collect();
    assert!(toks.len() >= 45, "{} token records", toks.len());

    // The run: every byte and call bpftrace saw is charged to a kind of region or unresolved.
    let sum = |f: &dyn Fn(&serde_json::Value) -> u64| toks.iter().map(|t| f(&t["explicit_reads"])).sum::<u64>();
    let all = |x: &serde_json::Value, k: &str| ["dense", "experts", "other"].iter().map(|r| u(&x[k], r)).sum::<u64>();
    let unresolved = sum(&|x| u(x, "unresolved_bytes"));
    let charged = sum(&|x| all(x, "bytes"));
    assert_uncharged_within_unresolved(charged, bt_bytes, unresolved, "bytes vs bpftrace's pread64 returns");
    let calls = sum(&|x| all(x, "calls"));
    assert_uncharged_within_unresolved(calls, bt_calls, sum(&|x| u(x, "unresolved_calls")), "calls vs bpftrace's");
    assert_eq!(sum(&|x| u(x, "lost_bytes")), 0, "per-expert records lost");
    let log_total: u64 = log.values().flat_map(|m| m.values()).sum();
    assert_eq!(log_total, bt_bytes, "the cache log's bytes vs bpftrace's pread64 returns");

    // Per grid: its read layers are the steps since the previous grid.
    let (mut span, mut grids, mut with_reads) = (Vec::new(), 0, 0);
    for t in &toks {
        span.push(*t);
        let g = &t["residency"]["grid"];
        if !g.is_object() {
            continue;
        }
        let steps = std::mem::take(&mut span);
        let (bytes, calls) = (g["read_bytes"].as_array().unwrap(), g["read_calls"].as_array().unwrap());
        let ne = u(g, "n_experts");
        let layers: Vec<u64> = g["layers"].as_array().unwrap().iter().map(|l| l.as_u64().unwrap()).collect();
        assert_eq!(bytes.len() as u64, layers.len() as u64 * ne, "{g}");
        if steps.iter().any(|s| u(&s["explicit_reads"], "unresolved_bytes") > 0) {
            continue; // reads charged to no expert: the log has them, the grid cannot
        }
        let mut want = PerExpert::new();
        for s in &steps {
            for (k, b) in log.get(&u(s, "index")).into_iter().flatten() {
                *want.entry(*k).or_default() += b;
            }
        }
        let mut got = PerExpert::new();
        for (row, &layer) in layers.iter().enumerate() {
            for e in 0..ne {
                let i = row * ne as usize + e as usize;
                let (b, c) = (bytes[i].as_u64().unwrap(), calls[i].as_u64().unwrap());
                assert_eq!(b > 0, c > 0, "layer {layer} expert {e}: {b} bytes in {c} calls");
                if b > 0 {
                    got.insert((layer, e), b);
                }
            }
        }
        let seqs: Vec<u64> = steps.iter().map(|s| u(s, "seq")).collect();
        assert_eq!(got, want, "grid of record {:?} (steps {seqs:?}) vs the cache log", seqs.last());
        grids += 1;
        with_reads += usize::from(!got.is_empty());
    }
    eprintln!(
        "{grids} grids checked, {with_reads} with reads; {bt_bytes} bytes in {bt_calls} preads, {unresolved} unresolved"
    );
    // The pauses end 4 batches after the prompt's; the first holds the unresolved reads.
    assert!(grids >= 3 && with_reads >= 2, "{grids} grids checked, {with_reads} with reads");
    assert_eq!(refreshes.last().unwrap()["experts"], heatmap_json(&trace, &[])[0]["experts"]);

    // The trace holds the same grids (packed), and `observer heatmap --trace` lists the run's reads.
    let h = Command::new(OBSERVER).args(["heatmap", "--trace", trace.to_str().unwrap(), "--json"]).output().unwrap();
    assert!(h.status.success(), "observer heatmap --trace: {}", String::from_utf8_lossy(&h.stderr));
    let hv: serde_json::Value = serde_json::from_slice(&h.stdout).unwrap();
    assert_eq!(u(&hv, "records"), toks.len() as u64, "{hv}");
    assert_eq!(u(&hv["bytes"], "experts"), sum(&|x| u(&x["bytes"], "experts")), "{hv}");
    let listed: PerExpert = hv["experts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| ((u(e, "layer"), u(e, "expert")), u(e, "read_bytes")))
        .collect();
    assert_eq!(listed, records_per_expert(toks.iter().copied()), "heatmap --trace vs the JSON's records");
    let log_all: PerExpert = log.values().flatten().fold(PerExpert::new(), |mut m, (k, b)| {
        *m.entry(*k).or_default() += b;
        m
    });
    let short = shortfall_against_the_log(&listed, &log_all, "heatmap --trace");
    assert_eq!(
        short,
        bt_bytes - u(&hv["bytes"], "experts"),
        "the experts' bytes missing vs bpftrace's uncharged bytes"
    );
    let txt = Command::new(OBSERVER).args(["heatmap", "--trace", trace.to_str().unwrap()]).output().unwrap();
    let txt = String::from_utf8_lossy(&txt.stdout);
    for ((layer, expert), b) in &listed {
        let row = format!("{layer:>6} {expert:>7} {b:>14}");
        assert!(txt.lines().any(|l| l.starts_with(&row)), "{row:?} in\n{txt}");
    }
}

/// `--window` records carry explicit reads: summed over the windows of a run they equal a bpftrace
/// sum of `pread64` returns on the model's descriptors, and per expert the engine's cache log
/// (same run); a window with a grid has the window's reads in its read layers.
#[test]
fn window_records_carry_explicit_reads_that_add_up_to_the_engines() {
    let _l = machine_lock();
    let model = tiny_model();
    let dir = scratch_dir("engine-xgrid");
    let (json, log) = (dir.join("windows.json"), dir.join("windows-loads.txt"));
    for f in [&json, &log] {
        let _ = std::fs::remove_file(f);
    }
    let bt = model_preads(&model);
    let out = Command::new(OBSERVER)
        // 20 ms windows over 200 tokens (about 0.5 s here: 384 tok/s): at least 3 windows on a
        // machine 8× faster (48 tokens in 50 ms windows made 2 on an idle run here).
        .args(["run", "--engine", "none", "--window", "20ms", "--every", "0", "--force"])
        .args(["--json", json.to_str().unwrap(), "--"])
        .arg(engine_bin())
        .args(["run", "-m", model.to_str().unwrap(), "-p", "The quick brown fox", "-n", "200"])
        .args(["--ignore-eos", "-t", "2", "--dense", "anon", "--experts", "cache", "--cache-mib", "1"])
        .args(["--cache-log", log.to_str().unwrap()])
        .output()
        .unwrap();
    let text = bt.finish();
    assert!(out.status.success(), "observer run failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let (bt_bytes, bt_calls) = model_pread_totals(&text, u(&v["target"], "pid"));
    let log = cache_log(&log);
    let wins: Vec<&serde_json::Value> = v["tokens"].as_array().unwrap().iter().collect();
    assert!(wins.len() >= 3, "{} windows", wins.len());
    let (mut bytes, mut calls, mut unresolved, mut unresolved_calls, mut with_reads) = (0, 0, 0, 0, 0);
    for w in &wins {
        assert_eq!(w["kind"], "window", "{w}");
        let x = &w["explicit_reads"];
        assert!(x.is_object(), "a window without explicit_reads: {w}");
        assert_eq!((u(&x["bytes"], "dense"), u(&x["bytes"], "other"), u(x, "lost_bytes")), (0, 0, 0), "{x}");
        bytes += u(&x["bytes"], "experts");
        calls += u(&x["calls"], "experts");
        unresolved += u(x, "unresolved_bytes");
        unresolved_calls += u(x, "unresolved_calls");
        with_reads += usize::from(u(&x["bytes"], "experts") > 0);
        // A window is its own batch: a grid it carries holds its reads.
        let g = &w["residency"]["grid"];
        if g.is_object() {
            let ne = u(g, "n_experts") as usize;
            let layers: Vec<u64> = g["layers"].as_array().unwrap().iter().map(|l| l.as_u64().unwrap()).collect();
            let mut got = PerExpert::new();
            for (i, b) in g["read_bytes"].as_array().unwrap().iter().enumerate() {
                if b.as_u64().unwrap() > 0 {
                    got.insert((layers[i / ne], (i % ne) as u64), b.as_u64().unwrap());
                }
            }
            assert_eq!(got, records_per_expert([*w]), "window {}: grid vs its explicit_reads.experts", u(w, "seq"));
        }
    }
    eprintln!("{} windows, {with_reads} with reads; {bt_bytes} bytes in {bt_calls} preads", wins.len());
    assert_uncharged_within_unresolved(
        bytes,
        bt_bytes,
        unresolved,
        "windows' expert bytes vs bpftrace's pread64 returns",
    );
    assert_uncharged_within_unresolved(calls, bt_calls, unresolved_calls, "windows' expert calls vs bpftrace's");
    let log_all: PerExpert = log.values().flatten().fold(PerExpert::new(), |mut m, (k, b)| {
        *m.entry(*k).or_default() += b;
        m
    });
    let short = shortfall_against_the_log(&records_per_expert(wins.iter().copied()), &log_all, "windows");
    assert_eq!(short, bt_bytes - bytes, "the experts' bytes missing vs bpftrace's uncharged bytes");
    assert!(with_reads >= 2, "{with_reads} windows with expert reads");
}

/// `observer heatmap MODEL --pid PID --watch --json` on a running engine that reads its experts
/// through its cache (`pread64`): attached while the engine is stopped before its start, it ends
/// once the engine has exited, and its last refresh lists, per expert, the bytes the engine's
/// `--cache-log` says it read (short only by the unresolved bytes), and per kind what a bpftrace
/// sum of `pread64` returns on the model's descriptors counted (same run).
#[test]
fn heatmap_of_a_live_pid_lists_its_explicit_reads_per_expert() {
    let _l = machine_lock();
    let model = tiny_model();
    let dir = scratch_dir("engine-xheat");
    let log = dir.join("live-loads.txt");
    let _ = std::fs::remove_file(&log);
    let bt = model_preads(&model);
    // A shell that stops itself, then becomes the engine (same PID): the heatmap attaches while
    // it is stopped, so it sees every read the engine makes, whatever the machine's speed.
    let script = format!(
        "kill -STOP $$; exec {} run -m {} -p 'The quick brown fox' -n 24 --ignore-eos -t 2 --dense anon \
         --experts cache --cache-mib 1 --cache-log {}",
        engine_bin().display(),
        model.display(),
        log.display()
    );
    let mut target = Command::new("/bin/sh").args(["-c", &script]).stdout(Stdio::null()).spawn().unwrap();
    let pid = target.id();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while state(pid) != 'T' {
        assert!(std::time::Instant::now() < deadline, "the target did not stop itself: state {}", state(pid));
        std::thread::sleep(Duration::from_millis(10));
    }
    /// Lets the engine go on if the test fails while it is stopped (and ends it).
    struct Resume(u32);
    impl Drop for Resume {
        fn drop(&mut self) {
            // SAFETY: kill(2) of the process this test started.
            unsafe {
                libc::kill(self.0 as i32, libc::SIGCONT);
                libc::kill(self.0 as i32, libc::SIGKILL);
            }
        }
    }
    let resume = Resume(pid);
    let mut h = Command::new(OBSERVER)
        .args(["heatmap", model.to_str().unwrap(), "--pid", &pid.to_string(), "--json", "--watch"])
        .args(["--interval", "100ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(h.stdout.take().unwrap());
    // Drained beside: a long error (a verifier log) must not fill the pipe and stall the heatmap
    // before its first line.
    let mut err = h.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    if first.is_empty() {
        panic!("observer heatmap --pid ended at once: {}; {}", h.wait().unwrap(), err.join().unwrap());
    }
    let first: serde_json::Value = serde_json::from_str(&first).unwrap();
    let r0 = &first["reads"];
    assert_eq!((u(r0, "pid"), &r0["exited"]), (u64::from(pid), &serde_json::json!(false)), "{r0}");
    assert_eq!(r0["experts"], serde_json::json!([]), "nothing read while stopped: {r0}");
    // Its probes are attached (the first refresh is after them): let the engine start.
    std::mem::forget(resume);
    // SAFETY: kill(2) of the process this test started.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let st = target.wait().unwrap();
    assert!(st.success(), "the engine failed: {st}");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let hst = h.wait().unwrap();
    assert!(hst.success(), "observer heatmap --pid: {hst}: {}", err.join().unwrap());
    let text = bt.finish();
    let refreshes: Vec<serde_json::Value> =
        std::iter::once(first).chain(rest.lines().map(|l| serde_json::from_str(l).unwrap())).collect();
    let last = &refreshes.last().unwrap()["reads"];
    // It ended by itself, at the first refresh that found the engine gone.
    assert_eq!(last["exited"], true, "{last}");
    assert!(refreshes[..refreshes.len() - 1].iter().all(|v| v["reads"]["exited"] == false));
    assert_eq!(u(last, "records"), refreshes.len() as u64, "one span per refresh");

    let (bt_bytes, bt_calls) = model_pread_totals(&text, u64::from(pid));
    let log = cache_log(&log);
    let log_total: u64 = log.values().flat_map(|m| m.values()).sum();
    assert_eq!(log_total, bt_bytes, "the cache log's bytes vs bpftrace's pread64 returns");
    let all = |k: &str| ["dense", "experts", "other"].iter().map(|r| u(&last[k], r)).sum::<u64>();
    let unresolved = u(last, "unresolved_bytes");
    assert_uncharged_within_unresolved(all("bytes"), bt_bytes, unresolved, "bytes vs bpftrace's pread64 returns");
    assert_uncharged_within_unresolved(all("calls"), bt_calls, u(last, "unresolved_calls"), "calls vs bpftrace's");
    assert_eq!(u(last, "lost_bytes"), 0, "per-expert records lost: {last}");
    // Per expert: the engine's log, short only by what was charged to no region.
    let listed = listed_per_expert(last);
    let log_all: PerExpert = log.values().flatten().fold(PerExpert::new(), |mut m, (k, b)| {
        *m.entry(*k).or_default() += b;
        m
    });
    let short = shortfall_against_the_log(&listed, &log_all, "heatmap --pid");
    assert_eq!(short, bt_bytes - u(&last["bytes"], "experts"), "the experts' bytes missing vs bpftrace's uncharged");
    assert_eq!(listed.values().sum::<u64>(), u(&last["bytes"], "experts"), "per expert vs the experts kind");
    let calls: u64 = last["experts"].as_array().unwrap().iter().map(|e| u(e, "read_calls")).sum();
    assert_eq!(calls, u(&last["calls"], "experts"), "read_calls per expert vs the experts kind's calls");
    // Each refresh's own span (`last`) adds up to the run's.
    let spans: u64 = refreshes
        .iter()
        .map(|v| &v["reads"]["last"])
        .filter(|x| x.is_object())
        .map(|x| u(&x["bytes"], "experts"))
        .sum();
    assert_eq!(spans, u(&last["bytes"], "experts"), "the refreshes' spans vs the run");
    eprintln!(
        "{} refreshes; {bt_bytes} bytes in {bt_calls} preads (bpftrace), {} experts listed, {short} bytes short of \
         the log, {unresolved} unresolved",
        refreshes.len(),
        listed.len()
    );
    assert!(listed.len() >= 8 && u(&last["bytes"], "experts") > 0, "a 1 MiB cache misses often: {last}");
}

/// The process whose parent is `parent` and whose name is `comm`, if any.
fn child_named(parent: u32, comm: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        let ppid: u32 = rest.split(' ').nth(1)?.parse().ok()?;
        (ppid == parent && name == comm).then_some(pid)
    })
}
