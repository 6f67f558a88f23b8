//! Eviction blame (`observer::capture::residency::evict`) against independent sources on the same
//! run: the pages a named process removes are checked against `fincore` before and after (the
//! page cache itself), with the kernel's own actors (DAMON's kdamond, kswapd) that may evict the
//! file at the same time taken out by their own rows; the table's sum is checked against the churn
//! counters' total. Every test takes the machine lock (they drop caches and change cgroup limits).

mod common;

use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::{machine_lock, resid_standin, scratch_dir, write_model};
use observer::capture::residency::{
    ModelFile,
    churn::{self, Churn, Counts},
    evict::{self, ActorRow, Table},
};

fn fincore_pages(path: &Path) -> u64 {
    let out = Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path)
        .output()
        .expect("fincore (util-linux) not found: install util-linux");
    assert!(out.status.success(), "fincore failed: {}", String::from_utf8_lossy(&out.stderr));
    let bytes: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("fincore RES bytes");
    bytes / 4096
}

fn run(argv: &[&str]) -> u32 {
    let mut child = Command::new(argv[0]).args(&argv[1..]).stdout(Stdio::null()).spawn().expect("spawn");
    let pid = child.id();
    let st = child.wait().expect("wait");
    assert!(st.success(), "{argv:?} failed: {st}");
    pid
}

fn drop_from_cache(path: &Path) {
    run(&["dd", &format!("if={}", path.display()), "iflag=nocache", "count=0", "status=none"]);
}

fn cat(path: &Path) {
    run(&["dd", &format!("if={}", path.display()), "of=/dev/null", "bs=1M", "status=none"]);
}

/// The probes on one model file.
struct Blame {
    _ebpf: aya::Ebpf,
    churn: Churn,
    path: std::path::PathBuf,
}

struct Mark {
    counts: Counts,
    table: Table,
    resident: u64,
}

impl Blame {
    fn attach(path: &Path) -> Blame {
        let m = ModelFile::open(path).unwrap();
        let mut ebpf = churn::load_standalone().unwrap();
        let churn = Churn::attach(&mut ebpf, path, &m.map, m.file.page).unwrap();
        if let Err(e) = &churn.blame {
            panic!("eviction blame not attached: {e}");
        }
        Blame { _ebpf: ebpf, churn, path: path.to_owned() }
    }

    fn mark(&self) -> Mark {
        Mark {
            counts: self.churn.read(),
            table: self.churn.blame().unwrap().unwrap(),
            resident: fincore_pages(&self.path),
        }
    }

    /// The rows of `actor` between two marks, checked: every evicted page has exactly one actor
    /// (the table's sum is the churn total), and `actor`'s pages are what `fincore` saw leave,
    /// plus what was added meanwhile, minus what the other actors evicted. `actor` matches one
    /// row (use [`Blame::check_rows`] for several).
    fn check(&self, a: &Mark, b: &Mark, actor: impl Fn(&ActorRow) -> bool) -> u64 {
        let rows = b.table.since(&a.table).rows.iter().filter(|r| actor(r)).count();
        assert_eq!(rows, 1, "one row for the named actor");
        self.check_rows(a, b, actor)
    }

    fn check_rows(&self, a: &Mark, b: &Mark, actor: impl Fn(&ActorRow) -> bool) -> u64 {
        let d = b.table.since(&a.table);
        let evicted = b.counts.del_pages - a.counts.del_pages;
        let added = b.counts.add_pages - a.counts.add_pages;
        eprintln!("{}", evict::render(&d, 4096));
        assert_eq!(d.pages(), evicted, "Σ actors vs the churn total of evicted pages");
        let named = d.pages_where(&actor);
        let others = evicted - named;
        let fincore = a.resident as i64 - b.resident as i64;
        eprintln!(
            "fincore {} -> {} pages; added {added}; named actor {named}; others {others}",
            a.resident, b.resident
        );
        assert_eq!(named as i64, fincore + added as i64 - others as i64, "named actor's pages vs fincore delta");
        assert!(named > 0, "the named actor evicted nothing");
        for r in &d.rows {
            assert_eq!(r.dense_pages + r.shared_pages + r.routed_pages + r.other_pages + r.spill_pages, r.pages);
        }
        named
    }
}

#[test]
fn fadvise_dontneed_by_a_named_process_is_blamed_on_it() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("fadvise.gguf"), 4, 16, 256, 32);
    drop_from_cache(&path);
    cat(&path);
    let b = Blame::attach(&path);
    let m0 = b.mark();
    assert!(m0.resident > 1000, "the model should be cached: {} pages", m0.resident);
    let pid = run(&["dd", &format!("if={}", path.display()), "iflag=nocache", "count=0", "status=none"]);
    let m1 = b.mark();
    let named = b.check(&m0, &m1, |r| {
        r.kind == "fadvise" && r.pid == pid && r.comm == "dd" && r.syscall.as_deref() == Some("fadvise64")
    });
    assert_eq!(m1.resident, 0, "dd iflag=nocache count=0 drops the whole file");
    let d = m1.table.since(&m0.table);
    let r = d.rows.iter().find(|r| r.pid == pid).unwrap();
    assert!(r.routed_pages > r.dense_pages && r.dense_pages > 0, "region split: {r:?}");
    eprintln!("fadvise: dd (pid {pid}) evicted {named} pages");
}

#[test]
fn drop_caches_by_a_shell_is_blamed_as_truncation_by_its_write() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("dropcaches.gguf"), 4, 16, 256, 32);
    drop_from_cache(&path);
    cat(&path);
    let b = Blame::attach(&path);
    let m0 = b.mark();
    run(&["sync"]);
    let pid = run(&["sh", "-c", "echo 1 > /proc/sys/vm/drop_caches"]);
    let m1 = b.mark();
    b.check(&m0, &m1, |r| {
        r.kind == "truncate" && r.pid == pid && r.comm == "sh" && r.syscall.as_deref() == Some("write")
    });
    assert_eq!(m1.resident, 0, "drop_caches drops every clean unmapped page");
}

fn limit_file(cg: &testkit::MemCgroup) -> std::path::PathBuf {
    match cg.group().version() {
        memcg::Version::V1 => cg.dir().join("memory.limit_in_bytes"),
        memcg::Version::V2 => cg.dir().join("memory.max"),
    }
}

#[test]
fn lowering_a_memcg_limit_blames_the_process_that_wrote_it() {
    let _l = machine_lock();
    // 8 layers × 16 experts × 3 × 272 KiB ≈ 105 MiB.
    let path = write_model(&scratch_dir("evict").join("limit.gguf"), 8, 16, 512, 32);
    drop_from_cache(&path);
    let cg = testkit::MemCgroup::new("evict-limit", 512 << 20).expect("memory cgroup");
    // The pages are charged to the group of the process that reads them in.
    let argv = cg.wrap(&["dd", &format!("if={}", path.display()), "of=/dev/null", "bs=1M", "status=none"]);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    run(&argv);
    let b = Blame::attach(&path);
    let m0 = b.mark();
    let cmd = format!("echo {} > '{}'", 8 << 20, limit_file(&cg).display());
    let pid = run(&["sh", "-c", &cmd]);
    let m1 = b.mark();
    drop(cg);
    let named = b.check(&m0, &m1, |r| {
        r.kind == "memcg_reclaim" && r.pid == pid && r.comm == "sh" && r.syscall.as_deref() == Some("write")
    });
    // The group holds at most 8 MiB afterwards: nearly all of the file went.
    assert!(named * 4096 > 80 << 20, "only {named} pages reclaimed");
}

#[test]
fn the_engines_own_memcg_limit_blames_the_engine() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("thrash.gguf"), 6, 16, 512, 32);
    drop_from_cache(&path);
    let b = Blame::attach(&path);
    let cg = testkit::MemCgroup::new("evict-thrash", 32 << 20).expect("memory cgroup");
    let m0 = b.mark();
    let p = path.to_str().unwrap();
    let argv = cg.wrap(&[resid_standin(), "cycle", "--model", p, "--first", "0", "--last", "11", "--rounds", "3"]);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let pid = run(&argv);
    let m1 = b.mark();
    drop(cg);
    let named = b.check(&m0, &m1, |r| r.kind == "memcg_reclaim" && r.pid == pid && r.comm == "resid_standin");
    let d = m1.table.since(&m0.table);
    let r = d.rows.iter().find(|r| r.pid == pid).unwrap();
    assert!(r.routed_pages > 0, "{r:?}");
    eprintln!("engine's own limit: resid_standin (pid {pid}) evicted {named} pages under its 32 MiB limit");
}

/// DAMON's `pageout` scheme on this VM (observed, never reconfigured) evicts cold file pages in
/// kdamond's context. The test leaves a file cold and waits, with a bound, for kdamond to evict
/// some of it; it fails, saying so, when kdamond does not (or when no DAMON scheme runs).
#[test]
fn damon_pageout_is_blamed_on_kdamond() {
    let _l = machine_lock();
    let admin = Path::new("/sys/kernel/mm/damon/admin/kdamonds");
    let running = std::fs::read_to_string(admin.join("0/state")).map(|s| s.trim() == "on").unwrap_or(false);
    assert!(running, "no running kdamond under {}: this test observes the host's DAMON scheme", admin.display());
    let path = write_model(&scratch_dir("evict").join("damon.gguf"), 8, 16, 512, 32);
    drop_from_cache(&path);
    cat(&path);
    let b = Blame::attach(&path);
    let m0 = b.mark();
    let bound = Duration::from_secs(300);
    let t = Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(5));
        let m = b.mark();
        let d = m.table.since(&m0.table);
        if d.pages_where(|r| r.kind == "proactive_reclaim" && r.comm.starts_with("kdamond")) > 0 {
            let named = b.check(&m0, &m, |r| r.kind == "proactive_reclaim" && r.comm.starts_with("kdamond"));
            eprintln!("DAMON: kdamond evicted {named} pages after {:?}", t.elapsed());
            return;
        }
        assert!(t.elapsed() < bound, "kdamond evicted none of the cold file within {bound:?}: DAMON did not fire");
    }
}

/// `observer heatmap --churn --watch --json` lists the actors of each refresh: a `dd` that drops
/// the cached model between two refreshes is its one row, with the pages `fincore` saw leave.
#[test]
fn the_heatmap_lists_who_evicted_between_refreshes() {
    use std::io::{BufRead, BufReader};
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("heatmap.gguf"), 4, 16, 256, 32);
    drop_from_cache(&path);
    cat(&path);
    let before = fincore_pages(&path);
    let mut child = Command::new(common::OBSERVER)
        .args([
            "heatmap",
            path.to_str().unwrap(),
            "--churn",
            "--watch",
            "--interval",
            "1500ms",
            "--count",
            "3",
            "--json",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("run observer heatmap");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first: serde_json::Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(first["evicted_by"], serde_json::json!([]), "nothing evicted before the first refresh");
    let pid = run(&["dd", &format!("if={}", path.display()), "iflag=nocache", "count=0", "status=none"]);
    let after = fincore_pages(&path);
    let rest: Vec<serde_json::Value> = lines.map(|l| serde_json::from_str(&l.unwrap()).unwrap()).collect();
    assert!(child.wait().unwrap().success());
    assert_eq!(rest.len(), 2);
    let evicted: u64 = rest.iter().map(|j| j["churn"]["evicted_pages"].as_u64().unwrap()).sum();
    let rows: Vec<&serde_json::Value> = rest.iter().flat_map(|j| j["evicted_by"].as_array().unwrap()).collect();
    let dd: u64 = rows
        .iter()
        .filter(|r| r["kind"] == "fadvise" && r["pid"] == pid && r["comm"] == "dd")
        .map(|r| r["pages"].as_u64().unwrap())
        .sum();
    let all: u64 = rows.iter().map(|r| r["pages"].as_u64().unwrap()).sum();
    eprintln!("heatmap: dd evicted {dd} of {all} pages; fincore {before} -> {after}");
    assert_eq!(all, evicted, "Σ evicted_by vs the refreshes' evicted_pages");
    assert_eq!(dd, before - after - (all - dd), "dd's pages vs fincore delta less the other actors'");
    assert!(dd > 1000, "dd evicted {dd} pages");
}

/// Cache pages `0..n` of `path` one by one (order-0 folios: `fadvise(DONTNEED)` of one page
/// skips a large folio around it).
fn cache_pages(path: &Path, n: u64) {
    use std::os::{fd::AsRawFd, unix::fs::FileExt};
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: plain advice on our own descriptor.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    let mut buf = [0u8; 4096];
    for p in 0..n {
        f.read_exact_at(&mut buf, p * 4096).unwrap();
    }
}

/// More actors than the table holds: the ones that do not fit are counted in their kind's
/// overflow row, and the rows still add up to the churn total and to `fincore`'s delta.
#[test]
fn actors_beyond_the_table_are_counted_in_their_kinds_overflow_row() {
    let _l = machine_lock();
    let max = observer_common::evict::MAX_ACTORS as u64;
    let n = max + 100;
    let path = write_model(&scratch_dir("evict").join("overflow.gguf"), 4, 16, 256, 32);
    drop_from_cache(&path);
    cache_pages(&path, n);
    let b = Blame::attach(&path);
    let m0 = b.mark();
    // One `dd` per page, each a new process: n actors of kind fadvise.
    let script = format!(
        "for i in $(seq 0 {}); do dd if='{}' of=/dev/null iflag=nocache bs=4096 skip=$i count=1 status=none; done",
        n - 1,
        path.display()
    );
    run(&["sh", "-c", &script]);
    let m1 = b.mark();
    let named = b.check_rows(&m0, &m1, |r| r.kind == "fadvise" && (r.comm == "dd" || r.overflow));
    let d = m1.table.since(&m0.table);
    let overflow: Vec<&ActorRow> = d.rows.iter().filter(|r| r.overflow).collect();
    assert_eq!(overflow.len(), 1, "one overflow row (kind fadvise): {overflow:?}");
    assert_eq!(overflow[0].kind, "fadvise");
    let listed = d.rows.iter().filter(|r| !r.overflow).count() as u64;
    assert!(listed <= max, "{listed} actors listed, more than the table's {max}");
    assert!(overflow[0].events >= n - max, "{} overflow events for {n} processes", overflow[0].events);
    eprintln!("{listed} actors listed, overflow row {} pages of {named}", overflow[0].pages);
}
