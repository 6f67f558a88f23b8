//! Per-token telemetry of `engine run`: the `bmoe_metrics v1` CSV and its JSON-lines twin, checked
//! against the engine's printed speed and against the kernel's own account of the process
//! (`wait4` rusage).

mod common;

use std::process::Command;

use common::*;

const N: usize = 48;

fn run_policy(dense: &str) -> (Finished, Bmoe, std::path::PathBuf) {
    let m = small_model();
    let csv = scratch(&format!("metrics-{dense}.csv"));
    let json = scratch(&format!("metrics-{dense}.jsonl"));
    let mut c = Command::new(ENGINE);
    c.arg("run").arg("-m").arg(&m);
    c.args(["-p", "The quick brown fox jumps over the lazy dog", "-n", &N.to_string(), "-t", "1"]);
    c.args(["--ignore-eos", "--json", "--dense", dense, "--resident-every-ms", "0"]);
    c.arg("--force").arg("--metrics-csv").arg(&csv).arg("--metrics-json").arg(&json);
    let f = run_with_rusage(c, &format!("metrics-{dense}"));
    let b = read_bmoe(&csv);
    (f, b, json)
}

#[test]
fn csv_parses_as_bmoe_metrics_v1_and_matches_the_printed_speed() {
    for dense in ["mmap", "anon", "locked"] {
        let (f, b, json) = run_policy(dense);
        let s = last_json(&f.stdout);
        let what = format!("--dense {dense}");

        // Header lines.
        let keys: Vec<&str> = b.model.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["model", "arch", "n_layer", "n_expert", "n_expert_used", "threads", "n_ctx"], "{what}");
        assert_eq!(b.model[1].1, "qwen3moe");
        assert_eq!(b.model[5].1, "1", "threads");
        assert_eq!(b.config("dense_weights"), Some(dense));
        assert_eq!(b.config("experts"), Some("mmap"));
        assert_eq!(b.config("dense_bytes").map(str::to_owned), Some(s["dense_bytes"].to_string()));

        // One row per generation step.
        assert_eq!(b.rows.len(), N - 1, "{what}: rows");
        assert_eq!(s["gen_steps"].as_u64(), Some((N - 1) as u64));
        assert_eq!(s["gen_tokens"].as_u64(), Some(N as u64));
        assert_eq!(b.col("step"), (1..N).map(|i| i as f64).collect::<Vec<_>>());
        assert!(b.col("steps").iter().all(|&v| v == (N - 1) as f64));

        // tok/s = rows / sum(wall_ms) agrees with the printed generation speed.
        let printed = s["gen_tok_s"].as_f64().unwrap();
        let csv = b.tok_s();
        let diff = (csv - printed).abs() / printed;
        assert!(diff < 0.02, "{what}: CSV {csv:.2} tok/s vs printed {printed:.2} tok/s ({:.2} %)", diff * 100.0);

        let wall = b.col("wall_ms");
        let compute = b.col("compute_ms");
        let mgmt = b.col("mgmt_ms");
        for i in 0..b.rows.len() {
            let r = |c: &str| b.col(c)[i];
            assert!(wall[i] > 0.0, "{what}: wall");
            // compute is the residual wall − io − stall − mgmt (3-decimal rounding of each).
            assert!((compute[i] + mgmt[i] + r("io_ms") + r("stall_ms") - wall[i]).abs() <= 0.002, "{what}: row {i}");
            assert!(mgmt[i] >= 0.0 && mgmt[i] < wall[i]);
            assert_eq!((r("io_ms"), r("stall_ms"), r("read_bytes")), (0.0, 0.0, 0.0), "no explicit reads");
            assert_eq!(r("cache_hit_pct"), -1.0, "no cache: not measured");
            assert_eq!(r("cache_budget_mib"), -1.0);
            assert_eq!(r("turn"), 0.0);
            let frac = r("dense_resident_frac");
            assert!((0.0..=1.0).contains(&frac), "{what}: dense_resident_frac {frac}");
            if dense != "mmap" {
                assert_eq!(frac, 1.0, "{what}: a fresh anonymous copy without pressure is resident");
            }
            assert!((r("majflt_mib") - r("majflt") * 4096.0 / 1048576.0).abs() < 0.006);
            assert!(r("rss_mib") > 0.0 && r("mem_available_mib") > 0.0 && r("mem_free_mib") > 0.0);
            assert!((r("rss_anon_mib") + r("rss_file_mib") - r("rss_mib")).abs() <= 0.2, "{what}: rss = anon + file");
            assert!(r("swap_mib") >= 0.0 && r("swap_free_mib") >= 0.0);
        }

        // Against the kernel's account of the whole process (wait4): the steps are part of it.
        let cpu: f64 = b.col("cpu_ms").iter().sum();
        assert!(cpu > 0.0 && cpu <= f.cpu_ms + 1.0, "{what}: rows' cpu {cpu:.2} ms vs process {:.2} ms", f.cpu_ms);
        let majflt: f64 = b.col("majflt").iter().sum();
        assert!(majflt <= f.majflt as f64, "{what}: rows' majflt {majflt} vs process {}", f.majflt);
        let max_rss = b.col("rss_mib").iter().fold(0f64, |a, &v| a.max(v));
        // Both read the kernel's per-CPU RSS counters approximately (error up to a batch per CPU),
        // and the CSV rounds to 0.1 MiB.
        assert!(max_rss <= f.maxrss_mib + 0.5, "{what}: rss {max_rss} MiB above the peak {} MiB", f.maxrss_mib);
        assert!(max_rss >= 0.5 * f.maxrss_mib, "{what}: rss {max_rss} MiB vs peak {} MiB", f.maxrss_mib);

        // The JSON lines: a header, then the same rows with null for not measured.
        let text = std::fs::read_to_string(&json).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines[0]["format"], "bmoe_metrics v1");
        assert_eq!(lines[0]["config"]["dense_weights"], dense);
        assert_eq!(lines.len(), b.rows.len() + 1);
        for (row, j) in b.rows.iter().zip(&lines[1..]) {
            for (c, &v) in b.columns.iter().zip(row) {
                let jv = &j[c.as_str()];
                if v == -1.0 {
                    assert!(jv.is_null(), "{what}: {c} not measured must be null, got {jv}");
                } else {
                    let x = jv.as_f64().unwrap_or_else(|| panic!("{what}: {c} = {jv}"));
                    // The CSV rounds (MiB to 1 decimal, ms to 3).
                    assert!((x - v).abs() <= 0.0501 + 1e-9 * v.abs(), "{what}: {c} JSON {x} vs CSV {v}");
                }
            }
        }
    }
}

#[test]
fn placement_puts_the_dense_weights_where_it_says() {
    // Without pressure: `anon`/`locked` hold the dense weights in anonymous memory, `mmap` does not.
    let m = pressure_model();
    let mut anon_by_policy = Vec::new();
    for dense in ["mmap", "anon", "locked"] {
        let csv = scratch(&format!("placement-{dense}.csv"));
        let out = engine(&[
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "Hello",
            "-n",
            "4",
            "-t",
            "1",
            "--ignore-eos",
            "--json",
            "--dense",
            dense,
            "--force",
            "--metrics-csv",
            csv.to_str().unwrap(),
        ]);
        let s = summary(&out);
        let dense_mib = s["dense_bytes"].as_f64().unwrap() / 1048576.0;
        let expert_mib = s["expert_bytes"].as_f64().unwrap() / 1048576.0;
        assert!(dense_mib > 40.0 && expert_mib > 20.0, "{dense_mib} / {expert_mib}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!(
                "dense weights {dense_mib:.1} MiB ({dense}), routed experts {expert_mib:.1} MiB (mmap)"
            )),
            "start-up report: {stderr}"
        );
        let b = read_bmoe(&csv);
        let anon = b.col("rss_anon_mib").last().copied().unwrap();
        anon_by_policy.push(anon);
        if dense == "mmap" {
            assert!(anon < dense_mib, "mmap: {anon} MiB of anonymous memory, dense is {dense_mib} MiB");
        } else {
            assert!(anon >= dense_mib, "{dense}: {anon} MiB of anonymous memory < dense {dense_mib} MiB");
            assert_eq!(b.col("dense_resident_frac").last().copied(), Some(1.0));
        }
    }
    assert!(anon_by_policy[1] - anon_by_policy[0] > 40.0, "anon copy not visible: {anon_by_policy:?}");
}
