//! Fault counts against `perf stat -e major-faults,minor-faults` attached to
//! the same process for the same span (both attach before the workload's
//! `exec` and stop when it exits).

mod common;

use common::*;

#[test]
fn fault_counts_match_perf_stat() {
    let _l = machine_lock();
    let dir = scratch_dir("perfstat");
    let file = dir.join("refault.bin");
    let (perf_text, v) = beside_perf_stat(&dir, &format!("{} demo --size 64M --path {}", workload(), file.display()));
    let maj = perf_count(&perf_text, "major-faults");
    let min = perf_count(&perf_text, "minor-faults");
    assert!(maj >= 16_000 && min >= 16_000, "the demo faults a lot: {perf_text}");
    assert_within("major faults vs perf stat", u(&v["totals"], "majflt"), maj, 0.02);
    assert_within("minor faults vs perf stat", u(&v["totals"], "minflt"), min, 0.02);
    // The whole-run attribution counts the same faults.
    let a = &v["attribution_totals"];
    assert_within("attributed major faults vs perf stat", u(a, "majflt_file") + u(a, "majflt_swap"), maj, 0.02);
    assert_within("attributed minor faults vs perf stat", u(a, "minflt"), min, 0.02);
}
