//! Dense placement under memory pressure: zram swap on, the engine in a cgroup whose limit is
//! smaller than the model plus an anonymous balloon beside it (testkit guards; the test process
//! never joins the cgroup, and the machine is restored on drop).
//!
//! `--dense anon`: the kernel swaps part of the dense copy to zram (the embedding rows that are
//! not read stay cold), so the engine reports `swap_mib > 0` and `dense_resident_frac < 1`.
//! `--dense locked`: the same copy is mlock'ed and stays resident (`dense_resident_frac == 1`).

mod common;

use std::time::Duration;

use common::*;

/// Memory for the engine itself beyond its dense weights (binary, heap, some of the experts).
const HEADROOM_MIB: u64 = 40;
const BALLOON_MIB: u64 = 64;
const N: usize = 32;

fn run_under_pressure(dense: &str) -> (Bmoe, testkit::PressureStats, f64) {
    assert_root("the pressure tests set up zram and a memory cgroup");
    let m = pressure_model();
    let model_mib = std::fs::metadata(&m).unwrap().len() as f64 / 1048576.0;
    let _l = testkit::machine_lock();
    // The file's pages are charged to the cgroup that reads them: start cold.
    uncache(&m);
    let dense_mib = {
        let g = engine::gguf::Gguf::open(&m).unwrap();
        g.tensors.iter().filter(|t| !t.is_routed_expert()).map(|t| t.size).sum::<u64>() as f64 / 1048576.0
    };
    let limit_mib = dense_mib.ceil() as u64 + HEADROOM_MIB;
    assert!((limit_mib as f64) < model_mib + BALLOON_MIB as f64, "the limit must be below model + balloon");
    let swaps_before = std::fs::read_to_string("/proc/swaps").unwrap();
    let csv = scratch(&format!("pressure-{dense}.csv"));
    let since = testkit::vmstat_snapshot();
    let (stats, cgroup_dir);
    {
        let p = testkit::Pressure::new(&testkit::PressureConfig {
            name: format!("engine-pressure-{dense}"),
            limit_bytes: limit_mib << 20,
            zram_mib: Some(512),
            balloon_mib: BALLOON_MIB,
            balloon_touch: Duration::from_millis(100),
        })
        .expect("pressure setup");
        cgroup_dir = p.cgroup.dir().to_path_buf();
        let args = [
            ENGINE,
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "Once upon a time",
            "-n",
            &N.to_string(),
            "-t",
            "1",
            "--ignore-eos",
            "--json",
            "--resident-every-ms",
            "0",
            "--dense",
            dense,
            "--force",
            "--metrics-csv",
            csv.to_str().unwrap(),
        ];
        let f = run_with_rusage(p.command(&args), &format!("pressure-{dense}"));
        assert_eq!(last_json(&f.stdout)["gen_steps"].as_u64(), Some((N - 1) as u64));
        stats = p.stats(&since);
        let mine = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        assert!(!mine.contains(cgroup_dir.file_name().unwrap().to_str().unwrap()), "the test joined the cgroup");
    }
    // Restored: cgroup gone, swap devices as before.
    assert!(!cgroup_dir.exists(), "{} not removed", cgroup_dir.display());
    assert_eq!(std::fs::read_to_string("/proc/swaps").unwrap(), swaps_before, "zram swap not torn down");
    assert!(stats.max_usage_bytes.unwrap() > (limit_mib - 2) << 20, "the run never reached its limit: {stats:?}");
    (read_bmoe(&csv), stats, dense_mib)
}

#[test]
fn anon_dense_weights_swap_to_zram_under_pressure() {
    let (b, stats, dense_mib) = run_under_pressure("anon");
    assert_eq!(b.rows.len(), N - 1);
    let swap = b.col("swap_mib");
    let frac = b.col("dense_resident_frac");
    let max_swap = swap.iter().fold(0f64, |a, &v| a.max(v));
    let min_frac = frac.iter().fold(1f64, |a, &v| a.min(v));
    assert!(max_swap > 0.0, "anon: swap_mib stayed 0: {swap:?} ({stats:?})");
    assert!(min_frac < 1.0, "anon: dense_resident_frac stayed 1: {frac:?}");
    assert!(frac.iter().all(|&f| (0.0..=1.0).contains(&f)), "{frac:?}");
    // Two independent accounts of the same pages: the dense pages mincore does not find resident
    // are swapped out, so the process's VmSwap covers them.
    for (&f, &s) in frac.iter().zip(&swap) {
        let out = (1.0 - f) * dense_mib;
        assert!(s + 0.5 >= out, "anon: {out:.1} MiB of dense weights not resident but VmSwap is {s} MiB");
    }
    assert!(stats.pswpout.unwrap() > 0, "no swap-out on the machine: {stats:?}");
}

#[test]
fn locked_dense_weights_stay_resident_under_pressure() {
    let (b, stats, _) = run_under_pressure("locked");
    assert_eq!(b.rows.len(), N - 1);
    let frac = b.col("dense_resident_frac");
    assert!(frac.iter().all(|&f| f == 1.0), "locked: dense_resident_frac {frac:?}");
    // The pressure was real: something (the balloon) was swapped out meanwhile.
    assert!(stats.pswpout.unwrap() > 0, "no swap-out on the machine: {stats:?}");
}
