//! A `testkit::damon` guard killed with SIGKILL: the DAMON admin tree stays changed, and the next
//! guard puts it back first, from the state file the killed one left.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use testkit::damon::{self, Damon, PageoutScheme, STATE_FILE};

#[test]
fn a_guard_killed_with_sigkill_is_put_back_by_the_next_guard() {
    let _l = testkit::machine_lock();
    damon::recover().expect("a state file an earlier run left");
    let before = damon::snapshot().expect("the DAMON admin tree");
    let cg = testkit::MemCgroup::new("damon-kill", 1 << 30).expect("memory cgroup");
    let path = cg.proc_path().expect("the memory cgroup of a process in it");
    let mut child = Command::new(env!("CARGO_BIN_EXE_damon_holder"))
        .arg(&path)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn damon_holder");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    if line.trim() != "ready" {
        let st = child.wait().unwrap();
        panic!("damon_holder did not start its kdamond ({st}); the next run restores from {STATE_FILE} if it left one");
    }
    let during = damon::snapshot().unwrap();
    assert_ne!(during, before, "the holder's kdamond is in the tree");
    assert!(std::path::Path::new(STATE_FILE).exists(), "a live guard keeps {STATE_FILE}");
    child.kill().unwrap(); // SIGKILL: no drop runs
    child.wait().unwrap();
    assert_eq!(damon::snapshot().unwrap(), during, "the killed guard left the tree changed");
    // The next guard restores first, then saves and starts its own; its restore puts back the first
    // state.
    let scheme = PageoutScheme {
        regions: vec![(1 << 30, (1 << 30) + (1 << 20))],
        memcg_path: path,
        sample: Duration::from_millis(5),
        aggregation: Duration::from_millis(100),
    };
    let next = Damon::pageout(&scheme).expect("the next guard");
    next.restore().expect("the next guard's restore");
    assert_eq!(damon::snapshot().unwrap(), before, "the tree is as before the killed guard");
    assert!(!std::path::Path::new(STATE_FILE).exists(), "{STATE_FILE} removed after the restore");
    drop(cg);
}
