//! Eviction blame (`observer::capture::residency::evict`) against independent sources on the same
//! run: the pages a named process removes are checked against `fincore` before and after (the
//! page cache itself), with the kernel's own actors (DAMON's kdamond, kswapd) that may evict the
//! file at the same time taken out by their own rows; the table's sum is checked against the churn
//! counters' total. Every test takes the machine lock (they drop caches, change cgroup limits and
//! start a kdamond).

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::{machine_lock, resid_standin, scratch_dir, write_model};
use observer::capture::residency::{
    ModelFile,
    churn::{self, Churn, Counts},
    evict::{self, ActorRow, Table},
};
use observer_common::model::{Counter, Event, EvictedBy, TokenRecord};

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

/// Proactive reclaim of a memory cgroup by a process writing its control file: `memory.reclaim`
/// on cgroup v2, `memory.force_empty` (the group's processes gone: it reclaims everything it can)
/// on v1. The reclaim runs in the writer's context inside the memcg reclaim tracepoints: kind
/// `memcg_reclaim`, system call `write`, the shell's pid; its pages match `fincore`'s delta and,
/// on v1, the group's own `memory.stat` (`total_cache` before, less after).
#[test]
fn proactive_reclaim_of_a_memcg_blames_the_writer() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("reclaim.gguf"), 8, 16, 512, 32);
    drop_from_cache(&path);
    let cg = testkit::MemCgroup::new("evict-reclaim", 1 << 30).expect("memory cgroup");
    let argv = cg.wrap(&["dd", &format!("if={}", path.display()), "of=/dev/null", "bs=1M", "status=none"]);
    run(&argv.iter().map(String::as_str).collect::<Vec<_>>());
    let cache = |cg: &testkit::MemCgroup| cg.group().stat().unwrap().get(memcg::StatKey::File);
    let b = Blame::attach(&path);
    let m0 = b.mark();
    let c0 = cache(&cg);
    // `memory.reclaim` fails the write with EAGAIN when it reclaimed less than asked (1 GiB of a
    // ~105 MiB group): the shell ignores that status; what it reclaimed is checked below.
    let (file, value, tail) = match cg.group().version() {
        memcg::Version::V1 => ("memory.force_empty", "0".to_string(), ""),
        memcg::Version::V2 => ("memory.reclaim", (1u64 << 30).to_string(), "; exit 0"),
    };
    let cmd = format!("echo {value} > '{}'{tail}", cg.dir().join(file).display());
    let pid = run(&["sh", "-c", &cmd]);
    let m1 = b.mark();
    let c1 = cache(&cg);
    drop(cg);
    let named = b.check(&m0, &m1, |r| {
        r.kind == "memcg_reclaim" && r.pid == pid && r.comm == "sh" && r.syscall.as_deref() == Some("write")
    });
    eprintln!("{file}: sh (pid {pid}) evicted {named} pages; the group's file pages {c0:?} -> {c1:?}");
    assert!(named * 4096 > 80 << 20, "only {named} pages reclaimed");
    if let (Some(c0), Some(c1)) = (c0, c1) {
        assert!(named * 4096 <= c0 - c1.min(c0), "blamed {named} pages, the group lost {} bytes of file", c0 - c1);
    }
}

/// The engine's own memcg limit: a `resid_standin` that cycles through the model's experts in a
/// group of 32 MiB reclaims the group's page cache itself (kind `memcg_reclaim`, its pid and comm;
/// pages as `fincore`'s delta less the other actors'). Its memcg: on cgroup v2 the row's cgroup ID is
/// the group directory's inode and the row names the group as `/proc/PID/cgroup` does (found from
/// the ID after the engine exited); on v1 the exited engine's memcg is not known (`None`).
#[test]
fn the_engines_own_memcg_limit_blames_the_engine() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("thrash.gguf"), 6, 16, 512, 32);
    drop_from_cache(&path);
    let b = Blame::attach(&path);
    let cg = testkit::MemCgroup::new("evict-thrash", 32 << 20).expect("memory cgroup");
    let memcg_path = cg.proc_path().expect("the group's path in /proc/PID/cgroup");
    let m0 = b.mark();
    let p = path.to_str().unwrap();
    let argv = cg.wrap(&[resid_standin(), "cycle", "--model", p, "--first", "0", "--last", "11", "--rounds", "3"]);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let pid = run(&argv);
    let m1 = b.mark();
    let (version, dir_ino) = (cg.group().version(), {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(cg.dir()).unwrap().ino()
    });
    drop(cg);
    let named = b.check(&m0, &m1, |r| r.kind == "memcg_reclaim" && r.pid == pid && r.comm == "resid_standin");
    let d = m1.table.since(&m0.table);
    let r = d.rows.iter().find(|r| r.pid == pid).unwrap();
    assert!(r.routed_pages > 0, "{r:?}");
    eprintln!(
        "engine's own limit ({version:?}): resid_standin (pid {pid}) evicted {named} pages under its 32 MiB limit; \
         memcg {:?}, cgroup v2 id {} (the group: {memcg_path}, inode {dir_ino})",
        r.memcg, r.cgroup_v2
    );
    match version {
        memcg::Version::V2 => {
            assert_eq!(r.cgroup_v2, dir_ino, "the row's cgroup v2 ID vs the group directory's inode");
            assert_eq!(r.memcg.as_deref(), Some(memcg_path.as_str()), "the row's memcg vs /proc/PID/cgroup");
        }
        memcg::Version::V1 => assert_eq!(r.memcg, None, "v1: the memcg of an exited actor is not known"),
    }
}

/// Physical address ranges `[start, end)` of the cached pages of `path`: a mapping of it is read
/// page by page and `/proc/self/pagemap` gives each page's frame (root only); frames closer than
/// `gap` bytes are merged into one range, `gap` doubling until at most 64 ranges remain.
fn physical_ranges(path: &Path) -> Vec<(u64, u64)> {
    use std::os::{fd::AsRawFd, unix::fs::FileExt};
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a private read-only mapping of our own file, unmapped below; only read through.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0) };
    assert_ne!(base, libc::MAP_FAILED, "mmap {}", path.display());
    let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut frames = Vec::new();
    for p in 0..len / 4096 {
        let addr = base as usize + p * 4096;
        // SAFETY: inside the mapping.
        unsafe { std::ptr::read_volatile(addr as *const u8) };
        let mut e = [0u8; 8];
        pagemap.read_exact_at(&mut e, (addr / 4096 * 8) as u64).unwrap();
        let e = u64::from_le_bytes(e);
        let pfn = e & ((1 << 55) - 1);
        if e >> 63 == 1 && pfn != 0 {
            frames.push(pfn * 4096);
        }
    }
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(base, len) };
    assert!(!frames.is_empty(), "pagemap gave no frames for {} (not root?)", path.display());
    frames.sort_unstable();
    let mut gap = 2 << 20;
    loop {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for &a in &frames {
            match ranges.last_mut() {
                Some(r) if a <= r.1 + gap => r.1 = r.1.max(a + 4096),
                _ => ranges.push((a, a + 4096)),
            }
        }
        if ranges.len() <= 64 {
            return ranges;
        }
        gap *= 2;
    }
}

/// DAMON: the test starts a `pageout` kdamond of its own (`testkit::damon`: physical addresses,
/// fast sampling, restricted to the file's frames and to folios charged to the test's memory
/// cgroup), waits with a bound until it has evicted half of the cached file, stops it, and puts
/// the DAMON admin tree back (checked). kdamond's rows must match `fincore`'s delta, and be
/// within what DAMON itself says it paged out (`sz_applied`).
#[test]
fn damon_pageout_is_blamed_on_kdamond() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("damon.gguf"), 8, 16, 512, 32);
    drop_from_cache(&path);
    let cg = testkit::MemCgroup::new("evict-damon", 1 << 30).expect("memory cgroup");
    let argv = cg.wrap(&["dd", &format!("if={}", path.display()), "of=/dev/null", "bs=1M", "status=none"]);
    run(&argv.iter().map(String::as_str).collect::<Vec<_>>());
    let scheme = testkit::damon::PageoutScheme {
        regions: physical_ranges(&path),
        memcg_path: cg.proc_path().expect("the memory cgroup of a process in it"),
        sample: Duration::from_millis(5),
        aggregation: Duration::from_millis(100),
    };
    let b = Blame::attach(&path);
    let m0 = b.mark();
    assert!(m0.resident > 10_000, "the model should be cached: {} pages", m0.resident);
    let damon = testkit::damon::Damon::pageout(&scheme).unwrap_or_else(|e| panic!("DAMON: {e:#}"));
    let pid = damon.pid().unwrap();
    let ours = |r: &ActorRow| r.kind == "proactive_reclaim" && r.pid == pid && r.comm.starts_with("kdamond");
    let bound = Duration::from_secs(60);
    let t = Instant::now();
    let (seen, applied) = loop {
        std::thread::sleep(Duration::from_millis(200));
        let seen = b.churn.blame().unwrap().unwrap().since(&m0.table).pages_where(ours);
        let applied = damon.applied_bytes().unwrap();
        if seen >= m0.resident / 2 {
            break (seen, applied);
        }
        assert!(
            t.elapsed() < bound,
            "the test's kdamond (pid {pid}) evicted {seen} of {} pages within {bound:?} (DAMON says it paged out \
             {applied} bytes; {} ranges): DAMON did not fire",
            m0.resident,
            scheme.regions.len()
        );
    };
    damon.stop().unwrap();
    let m1 = b.mark();
    damon.restore().expect("the DAMON admin tree put back as it was");
    drop(cg);
    let named = b.check(&m0, &m1, ours);
    eprintln!(
        "DAMON: kdamond (pid {pid}) evicted {named} pages in {:?}; DAMON's sz_applied {applied} bytes when {seen} \
         were seen",
        t.elapsed()
    );
    assert!(seen * 4096 <= applied, "blamed {seen} pages on kdamond, more than DAMON paged out ({applied} bytes)");
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
    // `fincore` once the churn programs are attached (they are by the first refresh): an empty-cache
    // CI run read it before the heatmap started, and 64 pages left the cache unseen in between.
    let before = fincore_pages(&path);
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

/// The heatmap's `refaulted_by`: a `dd` drops the cached model with `fadvise`, then a read brings
/// every page back (`fincore`: from none to all); the refreshes' `refaulted_by.fadvise` add up to
/// the pages `dd` evicted, and the text view says it. The refreshes are read until they have seen
/// all of it (their counts are cumulative), with a bound, so the machine's speed does not matter.
#[test]
fn the_heatmap_lists_the_refaults_of_each_kind() {
    use std::io::{BufRead, BufReader};
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("heatmap-refault.gguf"), 4, 16, 256, 32);
    drop_from_cache(&path);
    cat(&path);
    let mut child = Command::new(common::OBSERVER)
        .args(["heatmap", path.to_str().unwrap(), "--churn", "--watch", "--interval", "500ms", "--json"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("run observer heatmap");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = || -> serde_json::Value { serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap() };
    let first = next();
    assert_eq!(first["refaulted_by"], serde_json::json!({}), "nothing refaulted before the first refresh");
    let pid = run(&["dd", &format!("if={}", path.display()), "iflag=nocache", "count=0", "status=none"]);
    assert_eq!(fincore_pages(&path), 0, "dd dropped the whole file");
    cat(&path);
    let pages = std::fs::metadata(&path).unwrap().len().div_ceil(4096);
    assert_eq!(fincore_pages(&path), pages, "the read brought the whole file back");
    let (mut dd, mut refaulted, mut refaulted_all) = (0, 0, 0);
    let t = Instant::now();
    while refaulted < dd || dd == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "after 120 s of refreshes: dd evicted {dd} pages, {refaulted} refaults of fadvise seen"
        );
        let j = next();
        for r in j["evicted_by"].as_array().unwrap() {
            if r["kind"] == "fadvise" && r["pid"] == pid {
                dd += r["pages"].as_u64().unwrap();
            }
        }
        let by = j["refaulted_by"].as_object().unwrap();
        refaulted += by.get("fadvise").map_or(0, |v| v.as_u64().unwrap());
        refaulted_all += by.values().map(|v| v.as_u64().unwrap()).sum::<u64>();
    }
    let _ = child.kill();
    let _ = child.wait();
    eprintln!("heatmap: dd evicted {dd} pages; refaulted as fadvise {refaulted}, of any kind {refaulted_all}");
    assert_eq!(refaulted, dd, "refaults of fadvise vs the pages dd evicted (all read back)");
    assert!(dd > 1000, "dd evicted {dd} pages");
    assert!(refaulted_all <= pages, "more refaults ({refaulted_all}) than the file's {pages} pages");
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

/// The vocabulary index of an eviction actor kind.
fn kind(name: &str) -> usize {
    observer_common::vocab::EVICTION_ACTORS.iter().position(|r| r.name == name).unwrap()
}

/// `observer run --json --record` of the workload's `evict`: its token records, its own JSON
/// lines, and the trace.
fn run_evict_tokens(path: &Path, name: &str, n: u64) -> (Vec<TokenRecord>, Vec<serde_json::Value>, PathBuf) {
    run_workload_tokens("evict", path, name, n, &[])
}

/// `observer run --json --record` of the workload's subcommand `cmd` on `path`, with `extra`
/// arguments for it.
fn run_workload_tokens(
    cmd: &str,
    path: &Path,
    name: &str,
    n: u64,
    extra: &[&str],
) -> (Vec<TokenRecord>, Vec<serde_json::Value>, PathBuf) {
    let dir = scratch_dir("evict-tokens");
    let (trace, json) = (dir.join(format!("{name}.trace")), dir.join(format!("{name}.json")));
    let _ = std::fs::remove_file(&trace);
    let _ = std::fs::remove_file(&json);
    let p = path.to_str().unwrap();
    let o = Command::new(common::OBSERVER)
        .args(["run", "--json", json.to_str().unwrap(), "--record", trace.to_str().unwrap(), "--model", p])
        .args(["--", common::workload(), cmd, "--path", p, "--n", &n.to_string()])
        .args(extra)
        .output()
        .expect("run observer");
    assert!(o.status.success(), "observer run failed:\n{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let tokens: Vec<TokenRecord> = serde_json::from_value(summary["tokens"].clone()).unwrap();
    let own = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (tokens, own, trace)
}

/// Token records carry the per-token split of `pagecache_evicted` by who evicted: a workload
/// that, in each of its marked tokens, drops the model it read just before with
/// `posix_fadvise(DONTNEED)` counts the pages it dropped itself (`mincore` before and after).
/// Each token's `fadvise` pages are that count, and its kinds add up to its `pagecache_evicted`;
/// the trace carries the same split, and `observer diff` of two such runs compares evictions by
/// actor with the workload's own mean.
#[test]
fn each_token_carries_who_evicted_its_pages() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("tokens.gguf"), 4, 16, 256, 32);
    let n = 4;
    let (toks, own, trace_a) = run_evict_tokens(&path, "a", n);
    assert_eq!(toks.len(), own.len(), "a token record per workload token");
    assert_eq!(toks.len(), n as usize);
    for (t, w) in toks.iter().zip(&own) {
        let by = t.evicted_by.unwrap_or_else(|| panic!("token {} has no evicted_by", t.seq));
        let mine = w["evicted_pages"].as_u64().unwrap();
        eprintln!(
            "token {}: {:?}; the workload's own count {mine}",
            t.seq,
            by.iter().filter(|x| x.1 > 0).collect::<Vec<_>>()
        );
        assert_eq!(by.0[kind("fadvise")], mine, "token {}: fadvise pages vs the workload's own count", t.seq);
        assert!(mine > 1000, "the workload evicted only {mine} pages");
        assert_eq!(Some(by.total()), t.counters.get(Counter::PagecacheEvicted), "token {}: Σ kinds", t.seq);
    }
    // The trace carries the same split.
    let bytes = std::fs::read(&trace_a).unwrap();
    let mut r = observer::store::trace::Reader::new(&bytes[..], &trace_a).unwrap();
    let from_trace: Vec<Option<EvictedBy>> =
        r.by_ref().filter_map(|e| if let Event::Token(t) = e { Some(t.evicted_by) } else { None }).collect();
    assert_eq!(from_trace, toks.iter().map(|t| t.evicted_by).collect::<Vec<_>>());
    // diff: the rows by actor, each side's mean the workload's own.
    let (_, own_b, trace_b) = run_evict_tokens(&path, "b", n);
    let o = Command::new(common::OBSERVER)
        .args(["diff", "--json", trace_a.to_str().unwrap(), trace_b.to_str().unwrap()])
        .output()
        .expect("observer diff");
    assert!(o.status.success(), "observer diff failed:\n{}", String::from_utf8_lossy(&o.stderr));
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = d["comparisons"][0]["rows"].as_array().unwrap();
    let row = rows.iter().find(|r| r["metric"] == "evicted_by_fadvise").expect("a row evicted_by_fadvise");
    let mean = |own: &[serde_json::Value]| {
        own.iter().map(|w| w["evicted_pages"].as_u64().unwrap()).sum::<u64>() as f64 / own.len() as f64
    };
    for (side, own) in [("a", &own), ("b", &own_b)] {
        let v = row[side]["value"].as_f64().unwrap();
        assert!((v - mean(own)).abs() < 1e-6, "diff side {side}: {v} vs the workload's mean {}", mean(own));
    }
}

/// Refaults per actor: the pages a `dd` dropped with `fadvise` and a later read brought back are
/// counted as refaults of `fadvise`. The second read adds every page again (`fincore`: from none
/// to all), each of them a refault of the kind that evicted it, and every page `dd` evicted is
/// among them.
#[test]
fn pages_read_again_after_an_eviction_are_refaults_of_its_actor() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("refault.gguf"), 4, 16, 256, 32);
    drop_from_cache(&path);
    let b = Blame::attach(&path);
    cat(&path);
    let m0 = b.mark();
    assert_eq!(m0.table.refaults, [0; 7], "a first read is no refault");
    let pid = run(&["dd", &format!("if={}", path.display()), "iflag=nocache", "count=0", "status=none"]);
    let m1 = b.mark();
    let dd = m1.table.since(&m0.table).pages_where(|r| r.kind == "fadvise" && r.pid == pid);
    assert_eq!(m1.resident, 0, "dd dropped the whole file");
    cat(&path);
    let m2 = b.mark();
    let d = m2.table.since(&m1.table);
    let added = m2.counts.add_pages - m1.counts.add_pages;
    let pages = std::fs::metadata(&path).unwrap().len().div_ceil(4096);
    eprintln!("refaults by kind {:?}; dd evicted {dd}; added {added}; fincore {}", d.refaults, m2.resident);
    assert_eq!(m2.resident, pages, "the second read brought the whole file back");
    assert_eq!(added, pages, "the churn counters' adds vs fincore");
    assert_eq!(d.refaults.iter().sum::<u64>(), added, "every page added back had been evicted: refaults");
    assert_eq!(d.refaults[kind("fadvise")], dd, "every page dd evicted came back, as a refault of fadvise");
    assert_eq!(d.not_remembered, 0);
}

/// Refaults per token, with their cost: the workload's `refault` drops the file it read (outside
/// each token) and, in the token, touches every page through a mapping with `MADV_RANDOM`, one
/// major fault per page. Each token's refaults of `fadvise` are the pages the workload counts
/// back itself (`mincore`), which are the pages it had dropped; its refault faults are its major
/// faults (`getrusage`, the engine record); their `fault_io` is within the workload's own clock
/// around the touches and is nearly all of the token's `fault_io` (which also holds other faults'
/// blocked time, a few µs). The trace carries the same, and
/// `observer diff` has rows of both.
#[test]
fn each_token_carries_its_refaults_and_their_fault_io() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("refault-tokens.gguf"), 4, 16, 256, 32);
    let n = 3;
    let (toks, own, trace) = run_workload_tokens("refault", &path, "refault", n, &[]);
    assert_eq!(toks.len(), n as usize, "a token record per workload token");
    assert_eq!(own.len(), n as usize);
    let fadvise = kind("fadvise");
    for (t, w) in toks.iter().zip(&own) {
        let r = t.refaults.unwrap_or_else(|| panic!("token {} has no refaults", t.seq));
        let (evicted, back, touch) = (
            w["evicted_pages"].as_u64().unwrap(),
            w["refaulted_pages"].as_u64().unwrap(),
            w["touch_ns"].as_u64().unwrap(),
        );
        let majflt = t.engine.as_ref().and_then(|e| e.majflt).expect("the workload's getrusage majflt");
        let fault_io = t.components.get(observer_common::model::Component::FaultIo).unwrap();
        eprintln!(
            "token {}: refaults {:?}, faults {:?}, fault_io {:?} ns; the workload: evicted {evicted}, back {back}, \
             majflt {majflt}, touches {touch} ns; token fault_io {fault_io} ns",
            t.seq,
            r.pages.iter().filter(|x| x.1 > 0).collect::<Vec<_>>(),
            r.faults.iter().filter(|x| x.1 > 0).collect::<Vec<_>>(),
            r.fault_io_ns.iter().filter(|x| x.1 > 0).collect::<Vec<_>>(),
        );
        assert!(back > 1000, "the workload brought back only {back} pages");
        assert_eq!(back, evicted, "token {}: the workload brought back what it dropped", t.seq);
        assert_eq!(r.pages.0[fadvise], back, "token {}: refaults of fadvise vs the workload's mincore", t.seq);
        assert_eq!(r.pages.total(), back, "token {}: every refault is of fadvise", t.seq);
        assert_eq!(r.faults.0[fadvise], majflt, "token {}: refault faults vs the workload's major faults", t.seq);
        assert_eq!(r.faults.total(), r.faults.0[fadvise]);
        let io = r.fault_io_ns.0[fadvise];
        assert!(io > 0, "token {}: the refault faults waited for no disk read", t.seq);
        assert!(io <= touch, "token {}: refault fault_io {io} ns over the workload's own {touch} ns", t.seq);
        // The token's fault_io also holds what other faults spent blocked (a page lock, a few µs).
        assert!(io <= fault_io, "token {}: refault fault_io {io} ns over the token's {fault_io} ns", t.seq);
        assert!(2 * io >= fault_io, "token {}: refault fault_io {io} ns, under half the token's {fault_io}", t.seq);
    }
    let bytes = std::fs::read(&trace).unwrap();
    let mut rd = observer::store::trace::Reader::new(&bytes[..], &trace).unwrap();
    let from_trace: Vec<_> =
        rd.by_ref().filter_map(|e| if let Event::Token(t) = e { Some(t.refaults) } else { None }).collect();
    assert_eq!(from_trace, toks.iter().map(|t| t.refaults).collect::<Vec<_>>(), "the trace's refaults");
    let o = Command::new(common::OBSERVER)
        .args(["diff", "--json", trace.to_str().unwrap(), trace.to_str().unwrap()])
        .output()
        .expect("observer diff");
    assert!(o.status.success(), "observer diff failed:\n{}", String::from_utf8_lossy(&o.stderr));
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = d["comparisons"][0]["rows"].as_array().unwrap();
    let value = |metric: &str| {
        let row = rows.iter().find(|r| r["metric"] == metric).unwrap_or_else(|| panic!("no diff row {metric}"));
        row["a"]["value"].as_f64().unwrap()
    };
    let mean = |f: &dyn Fn(&TokenRecord) -> u64| toks.iter().map(f).sum::<u64>() as f64 / toks.len() as f64;
    let own_mean = own.iter().map(|w| w["refaulted_pages"].as_u64().unwrap()).sum::<u64>() as f64 / n as f64;
    assert!((value("refaulted_by_fadvise") - own_mean).abs() < 1e-6, "diff refaulted_by_fadvise vs the workload");
    let io_ms = mean(&|t| t.refaults.unwrap().fault_io_ns.0[fadvise]) / 1e6;
    assert!((value("refault_io_fadvise_ms") - io_ms).abs() < 1e-9 * io_ms.max(1.0), "diff refault_io_fadvise_ms");
    // Prometheus, fed the same run's trace: the refault families per actor kind equal the JSON's
    // token records summed, kind by kind.
    let m = exposition(&trace);
    for (k, row) in observer_common::vocab::EVICTION_ACTORS.iter().enumerate() {
        let sum = |f: &dyn Fn(&observer_common::model::Refaults) -> u64| {
            toks.iter().map(|t| f(&t.refaults.unwrap())).sum::<u64>() as f64
        };
        let actor = format!(r#"actor="{}""#, row.name);
        assert_eq!(series_sum(&m, "moe_observer_refaulted_pages_total", &actor), sum(&|r| r.pages.0[k]), "{actor}");
        assert_eq!(series_sum(&m, "moe_observer_refault_faults_total", &actor), sum(&|r| r.faults.0[k]), "{actor}");
        let io = series_sum(&m, "moe_observer_refault_io_seconds_total", &actor);
        assert!((io - sum(&|r| r.fault_io_ns.0[k]) / 1e9).abs() < 1e-9, "{actor}: refault_io_seconds_total {io}");
    }
    assert!(series_sum(&m, "moe_observer_refaulted_pages_total", r#"actor="fadvise""#) > 1000.0);
}

/// The refault cost per expert (grid layers `refault_faults`, `refault_io_ns`) and `observer heatmap
/// --trace`. The workload's `refault` drops the model with `fadvise` before each token and, in the
/// token, touches every page of one layer's expert tensors (the longest run of pages that belong
/// to experts by the churn intervals' rule, from the model's own tensor table) through a mapping
/// with `MADV_RANDOM`: one major fault per page. So each expert's refault faults over the run are
/// its pages in that range times the tokens, and no other cell has any; every touched expert has
/// some `fault_io`; and since every refault fault of the run is an expert's, the cells' `fault_io`
/// summed over the run's grids equals the token records' refault `fault_io` summed over the kinds,
/// exactly (one kernel event adds to both). `observer heatmap --trace --json` lists the same cells,
/// costliest first, and its terminal table shows the costliest one.
#[test]
fn the_heatmap_shows_the_refault_cost_of_each_expert() {
    let _l = machine_lock();
    let path = write_model(&scratch_dir("evict").join("refault-cells.gguf"), 4, 16, 256, 32);
    let m = ModelFile::open(&path).unwrap();
    let page = m.file.page;
    let file_pages = std::fs::metadata(&path).unwrap().len().div_ceil(page);
    let iv = churn::Intervals::build(&m.map, page);
    let is_cell = |i: usize| matches!(iv.owners[i], churn::Owner::Cell(_));
    // The longest run of consecutive expert intervals: [a, b).
    let (mut best, mut i) = ((0, 0), 0);
    while i < iv.owners.len() {
        let a = i;
        while i < iv.owners.len() && is_cell(i) {
            i += 1;
        }
        if i - a > best.1 - best.0 {
            best = (a, i);
        }
        i += 1;
    }
    let (a, b) = best;
    assert!(b > a + 1, "no run of expert intervals in the test model");
    let (first, end) = (iv.starts[a], iv.starts[b]);
    let mut want = vec![0u64; m.map.n_cells()];
    for k in a..b {
        let churn::Owner::Cell(c) = iv.owners[k] else { unreachable!() };
        want[c as usize] += iv.pages(k, file_pages);
    }
    let n = 3;
    let range = format!("{first}..{end}");
    let (toks, own, trace) = run_workload_tokens("refault", &path, "refault-cells", n, &["--pages", &range]);
    assert_eq!(toks.len(), n as usize, "a token record per workload token");
    let fadvise = kind("fadvise");
    for (t, w) in toks.iter().zip(&own) {
        let r = t.refaults.unwrap_or_else(|| panic!("token {} has no refaults", t.seq));
        let majflt = t.engine.as_ref().and_then(|e| e.majflt).expect("the workload's getrusage majflt");
        assert_eq!(w["refaulted_pages"].as_u64().unwrap(), end - first, "token {}: the workload's mincore", t.seq);
        assert_eq!((r.faults.total(), r.faults.0[fadvise]), (majflt, majflt), "token {}: refault faults", t.seq);
    }
    // The run's grids, summed per cell.
    let bytes = std::fs::read(&trace).unwrap();
    // A grid counts since the previous grid, so the grids cover the tokens up to the last one that
    // carries a grid (`covered`), and exactly those. Records drained after the workload exited
    // carry one too (`Sampler::process_ended`): every token is covered (an empty-cache run had 2
    // grids for 3 tokens when they carried none).
    let (mut faults, mut io, mut grids, mut covered) = (vec![0u64; want.len()], vec![0u64; want.len()], 0, 0u64);
    let mut seen = 0u64;
    for e in observer::store::trace::Reader::new(&bytes[..], &trace).unwrap() {
        let Event::Token(t) = e else { continue };
        seen += 1;
        let Some(g) = t.residency.as_ref().and_then(|r| r.grid.as_ref()) else { continue };
        covered = seen;
        let (f, x) =
            (g.refault_faults.as_ref().expect("refault_faults"), g.refault_io_ns.as_ref().expect("refault_io_ns"));
        grids += 1;
        for c in 0..want.len() {
            faults[c] += u64::from(f[c]);
            io[c] += x[c];
        }
    }
    let tokens_io: u64 = toks.iter().take(covered as usize).map(|t| t.refaults.unwrap().fault_io_ns.total()).sum();
    let touched = want.iter().filter(|&&p| p > 0).count();
    eprintln!(
        "pages {range} ({} experts); {grids} grids; refault fault_io: cells {} ns, tokens {tokens_io} ns",
        touched,
        io.iter().sum::<u64>()
    );
    assert_eq!(covered, seen, "the last record carries a grid, also when drained after the workload exited");
    for c in 0..want.len() {
        assert_eq!(faults[c], covered * want[c], "cell {c}: refault faults vs its pages touched × {covered} tokens");
        assert_eq!(io[c] > 0, want[c] > 0, "cell {c}: fault_io {} ns for {} pages touched", io[c], want[c]);
    }
    assert_eq!(
        io.iter().sum::<u64>(),
        tokens_io,
        "Σ cells' refault fault_io vs Σ tokens' (every refault is an expert's)"
    );
    // The heatmap of the trace: the same cells, costliest first.
    let o = Command::new(common::OBSERVER)
        .args(["heatmap", "--json", "--trace", trace.to_str().unwrap()])
        .output()
        .expect("observer heatmap");
    assert!(o.status.success(), "observer heatmap --trace failed:\n{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let experts = v["refaults"]["experts"].as_array().expect("refaults.experts");
    let listed: Vec<_> = experts.iter().filter(|e| e["refault_faults"].as_u64().unwrap() > 0).collect();
    assert_eq!(listed.len(), touched, "{experts:?}");
    let n_e = m.map.n_experts as usize;
    let mut last = u64::MAX;
    for e in listed {
        let (layer, expert) = (e["layer"].as_u64().unwrap() as u32, e["expert"].as_u64().unwrap() as usize);
        let row = m.map.moe_layers.iter().position(|&l| l == layer).unwrap();
        let c = row * n_e + expert;
        assert_eq!((e["refault_faults"].as_u64(), e["refault_io_ns"].as_u64()), (Some(faults[c]), Some(io[c])), "{e}");
        assert!(io[c] <= last, "not costliest first: {experts:?}");
        last = io[c];
    }
    // Per kind of eviction, over every token of the run (grids or not).
    let all_io: u64 = toks.iter().map(|t| t.refaults.unwrap().fault_io_ns.total()).sum();
    assert_eq!(v["refaults"]["refault_io_ns_by"]["fadvise"].as_u64(), Some(all_io));
    let o = Command::new(common::OBSERVER).args(["heatmap", "--trace", trace.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    let top = |k: &str| experts[0][k].as_u64().unwrap();
    let row = format!(
        "{:>6} {:>7} {:>10} {:>8} {:>12.3}",
        top("layer"),
        top("expert"),
        top("evicted"),
        top("refault_faults"),
        top("refault_io_ns") as f64 / 1e6
    );
    assert!(text.contains("costliest first") && text.contains(&row), "{row:?} in\n{text}");
}

/// The Prometheus text exposition of a recorded run: its trace's events fed to an exporter's sink.
fn exposition(trace: &Path) -> String {
    use observer::sinks::{Sink, prometheus};
    let bytes = std::fs::read(trace).unwrap();
    let ex = prometheus::Exporter::new();
    let mut sink = ex.sink();
    for e in observer::store::trace::Reader::new(&bytes[..], trace).unwrap() {
        sink.event(&e).unwrap();
    }
    ex.render(prometheus::Format::Text).unwrap()
}

/// The series of `metric` (no other metric's) whose labels contain `label`, as `(labels, value)`.
fn series<'a>(m: &'a str, metric: &str, label: &str) -> Vec<(&'a str, f64)> {
    m.lines()
        .filter_map(|l| l.strip_prefix(metric)?.strip_prefix('{'))
        .filter_map(|l| l.rsplit_once("} "))
        .filter(|(labels, _)| labels.contains(label))
        .map(|(labels, v)| (labels, v.trim().parse().unwrap()))
        .collect()
}

fn series_sum(m: &str, metric: &str, label: &str) -> f64 {
    series(m, metric, label).iter().map(|x| x.1).sum()
}

/// More evicting process names than Prometheus gives a label of their own: twelve links to `dd`
/// with twelve names (`comm`) each drop the cached model with `fadvise`, one after the other,
/// under `observer run`. The JSON summary lists each process with the pages it dropped
/// (`fincore` before and after each, written by the script), and Prometheus, fed the same
/// run's trace, has at most `TOP_ACTOR_NAMES` names plus `other`, whose series add up to the
/// JSON's rows exactly: the named ones to their rows, `other` to the rest.
#[test]
fn evicting_process_names_are_a_bounded_label_whose_other_carries_the_rest() {
    let _l = machine_lock();
    let top = observer_common::vocab::TOP_ACTOR_NAMES;
    let n = top + 4;
    let dir = scratch_dir("evict-names");
    let path = write_model(&dir.join("names.gguf"), 4, 16, 256, 32);
    let dd = String::from_utf8(Command::new("sh").args(["-c", "command -v dd"]).output().unwrap().stdout).unwrap();
    let names: Vec<String> = (0..n).map(|i| format!("evictor{i:02}")).collect();
    for name in &names {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(dd.trim(), &link).unwrap();
    }
    let log = dir.join("fincore.log");
    let p = path.display();
    let script = names
        .iter()
        .map(|name| {
            format!(
                "cat '{p}' > /dev/null; fincore --bytes --noheadings --output RES '{p}' >> '{log}'; \
                 '{dir}/{name}' if='{p}' iflag=nocache count=0 status=none; \
                 fincore --bytes --noheadings --output RES '{p}' >> '{log}'",
                log = log.display(),
                dir = dir.display()
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let _ = std::fs::remove_file(&log);
    let (trace, json) = (dir.join("names.trace"), dir.join("names.json"));
    let _ = std::fs::remove_file(&trace);
    let _ = std::fs::remove_file(&json);
    let o = Command::new(common::OBSERVER)
        .args(["run", "--json", json.to_str().unwrap(), "--record", trace.to_str().unwrap()])
        .args(["--model", path.to_str().unwrap(), "--", "sh", "-c", &script])
        .output()
        .expect("run observer");
    assert!(o.status.success(), "observer run failed:\n{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows: Vec<observer_common::model::ProcessEvictions> =
        serde_json::from_value(summary["evicted_by_process"].clone()).unwrap();
    for r in &rows {
        eprintln!("{:<18} {:>7} {:<16} {:>8}", r.kind, r.pid, r.comm, r.pages);
    }
    let fincore: Vec<u64> =
        std::fs::read_to_string(&log).unwrap().lines().map(|l| l.trim().parse::<u64>().unwrap() / 4096).collect();
    assert_eq!(fincore.len(), 2 * n, "two fincore counts per process");
    // Pages the other kinds took while the script ran (DAMON's kdamond may run here).
    let others: u64 = rows.iter().filter(|r| r.kind != "fadvise").map(|r| r.pages).sum();
    for (i, name) in names.iter().enumerate() {
        let mine: Vec<_> = rows.iter().filter(|r| r.comm == *name).collect();
        assert_eq!(mine.len(), 1, "{name}: one row: {rows:?}");
        assert_eq!(mine[0].kind, "fadvise", "{name}");
        let (before, after) = (fincore[2 * i], fincore[2 * i + 1]);
        assert_eq!(after, 0, "{name} dropped the whole file");
        assert!(
            mine[0].pages <= before && mine[0].pages + others >= before,
            "{name}: {} pages, fincore {before} -> {after}, other kinds {others}",
            mine[0].pages
        );
        assert!(mine[0].pages > 1000, "{name}: {} pages", mine[0].pages);
    }
    // Prometheus: bounded names, `other` the rest, kind by kind.
    let m = exposition(&trace);
    let f = "moe_observer_pagecache_evicted_by_name_pages_total";
    let all = series(&m, f, "");
    let label = |labels: &str, k: &str| {
        let v = labels.split(&format!(r#"{k}=""#)).nth(1).unwrap();
        v[..v.find('"').unwrap()].to_string()
    };
    let mut named: Vec<String> = all.iter().map(|(l, _)| label(l, "actor_name")).collect();
    named.sort();
    named.dedup();
    eprintln!("actor_name values: {named:?}");
    assert!(named.len() <= top + 1, "{} actor_name values, more than {top} names and other", named.len());
    assert!(named.contains(&"other".to_string()), "{n} names, only {top} labels: the rest is other");
    assert_eq!(named.iter().filter(|x| x.starts_with("evictor")).count(), top, "the first {top} names: {named:?}");
    for kind in observer_common::vocab::EVICTION_ACTORS.iter().map(|r| r.name) {
        let json: u64 = rows.iter().filter(|r| r.kind == kind).map(|r| r.pages).sum();
        let prom = series_sum(&m, f, &format!(r#"actor="{kind}""#));
        assert_eq!(prom, json as f64, "{kind}: Σ series vs the JSON's rows");
        for name in named.iter().filter(|x| *x != "other") {
            let mine: u64 = rows.iter().filter(|r| r.kind == kind && r.comm == *name).map(|r| r.pages).sum();
            let v = series_sum(&m, f, &format!(r#"actor="{kind}",actor_name="{name}""#));
            assert_eq!(v, mine as f64, "{kind} {name}");
        }
        let rest: u64 = rows.iter().filter(|r| r.kind == kind && !named.contains(&r.comm)).map(|r| r.pages).sum();
        let rest = rest + rows.iter().filter(|r| r.kind == kind && r.pid == 0).map(|r| r.pages).sum::<u64>();
        let v = series_sum(&m, f, &format!(r#"actor="{kind}",actor_name="other""#));
        assert_eq!(v, rest as f64, "{kind}: other vs the rows without a name of their own");
    }
    let total: u64 = rows.iter().map(|r| r.pages).sum();
    assert_eq!(series_sum(&m, f, ""), total as f64, "Σ series vs Σ rows");
    assert!(total >= n as u64 * 1000);
}

/// `MemFree` of `/proc/meminfo`, bytes.
fn mem_free() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("MemFree:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("MemFree in /proc/meminfo");
    kb << 10
}

/// kswapd under real global pressure, safely. The model is read into a memory cgroup (no limit)
/// whose soft limit is 0 (cgroup v1: kswapd reclaims the groups over their soft limit first), then
/// a process in the group reads a sparse file (holes: page cache filled with zeros, no disk I/O)
/// larger than the free memory: the zones fall under their low watermarks and kswapd reclaims,
/// from the test's group first, its oldest pages (the model's) first. The reader is stopped as
/// soon as kswapd has evicted half of the model, and the sparse file is deleted (its cache freed).
/// Raising `vm.watermark_scale_factor` alone does not wake kswapd here: an allocation that finds
/// the Normal zone under its low watermark is served from DMA32 (2.4 GB free of 3 GB on this VM,
/// above any low watermark the factor's maximum 3000 gives it), so no allocation takes the slow
/// path that wakes kswapd. The kswapd rows must match `fincore`'s delta, be within
/// `/proc/vmstat`'s `pgsteal_kswapd` delta, and within what the group lost of its file pages
/// (`memory.stat`).
#[test]
fn kswapd_under_global_pressure_is_blamed_on_kswapd() {
    let _l = machine_lock();
    let dir = scratch_dir("evict");
    let path = write_model(&dir.join("kswapd.gguf"), 8, 16, 512, 32);
    drop_from_cache(&path);
    let cg = testkit::MemCgroup::new("evict-kswapd", 64 << 30).expect("memory cgroup");
    if cg.group().version() == memcg::Version::V1 {
        std::fs::write(cg.dir().join("memory.soft_limit_in_bytes"), "0").unwrap();
    }
    let argv = cg.wrap(&["dd", &format!("if={}", path.display()), "of=/dev/null", "bs=1M", "status=none"]);
    run(&argv.iter().map(String::as_str).collect::<Vec<_>>());
    let cache = |cg: &testkit::MemCgroup| cg.group().stat().unwrap().get(memcg::StatKey::File);
    let sparse = dir.join("kswapd.sparse");
    let size = mem_free() + (2 << 30);
    std::fs::File::create(&sparse).unwrap().set_len(size).unwrap();
    let b = Blame::attach(&path);
    let m0 = b.mark();
    assert!(m0.resident > 10_000, "the model should be cached: {} pages", m0.resident);
    let (c0, steal0) = (cache(&cg), testkit::vmstat("pgsteal_kswapd").expect("pgsteal_kswapd in /proc/vmstat"));
    let kswapd = |r: &ActorRow| r.kind == "kswapd" && r.comm.starts_with("kswapd");
    let argv = cg.wrap(&["dd", &format!("if={}", sparse.display()), "of=/dev/null", "bs=1M", "status=none"]);
    let mut reader = Command::new(&argv[0]).args(&argv[1..]).spawn().expect("spawn dd");
    let t = Instant::now();
    // Until kswapd has taken half the model, or the reader is done (a CI run: 11492 of 26861 pages
    // by the end of 27 GB of holes, how far kswapd gets depends on the rest of the machine); it
    // must have reached the file, and then what it took is checked page for page below.
    let seen = loop {
        std::thread::sleep(Duration::from_millis(50));
        let seen = b.churn.blame().unwrap().unwrap().since(&m0.table).pages_where(kswapd);
        if seen >= m0.resident / 2 {
            break seen;
        }
        if let Some(st) = reader.try_wait().unwrap() {
            if seen < 1000 {
                let _ = std::fs::remove_file(&sparse);
                panic!(
                    "kswapd evicted {seen} of {} pages while dd read {size} bytes of holes ({st}; pgsteal_kswapd +{}): \
                     it did not reach the file",
                    m0.resident,
                    testkit::vmstat("pgsteal_kswapd").unwrap() - steal0
                );
            }
            break seen;
        }
    };
    let _ = reader.kill();
    let _ = reader.wait();
    std::fs::remove_file(&sparse).unwrap();
    let m1 = b.mark();
    let (c1, steal1) = (cache(&cg), testkit::vmstat("pgsteal_kswapd").unwrap());
    drop(cg);
    let named = b.check_rows(&m0, &m1, kswapd);
    eprintln!(
        "kswapd evicted {named} pages ({seen} when seen) in {:?}; pgsteal_kswapd +{}; the group's file {c0:?} -> {c1:?}",
        t.elapsed(),
        steal1 - steal0
    );
    assert!(named <= steal1 - steal0, "blamed {named} pages on kswapd, more than it stole ({})", steal1 - steal0);
}

/// An ftrace instance of its own with one event on (removed on drop).
struct TraceInstance(PathBuf);

impl TraceInstance {
    fn new(name: &str, event: &str) -> TraceInstance {
        let root = Path::new("/sys/kernel/tracing");
        assert!(root.join("instances").is_dir(), "tracefs is not mounted at {}", root.display());
        let dir = root.join("instances").join(name);
        if dir.exists() {
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let t = TraceInstance(dir);
        std::fs::write(t.0.join("buffer_size_kb"), "8192").unwrap();
        std::fs::write(t.0.join("events").join(event).join("enable"), "1")
            .unwrap_or_else(|e| panic!("enabling {event}: {e}"));
        t
    }

    /// The trace so far (events are not consumed).
    fn text(&self) -> String {
        std::fs::read_to_string(self.0.join("trace")).unwrap()
    }
}

impl Drop for TraceInstance {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0.join("tracing_on"), "0");
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `Σ nr_reclaimed` and the count of `vmscan:mm_vmscan_direct_reclaim_end` events of task `pid`
/// in an ftrace text (`dd-1234 [000] ..... 12.3: mm_vmscan_direct_reclaim_end: nr_reclaimed=32`).
fn direct_reclaimed_by(trace: &str, pid: u32) -> (u64, u64) {
    let me = format!("-{pid} ");
    let lines = trace.lines().filter(|l| !l.starts_with('#') && l.contains(&me) && l.contains("direct_reclaim_end"));
    lines.fold((0, 0), |(sum, n), l| {
        let v = l.split("nr_reclaimed=").nth(1).and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
        (sum + v.unwrap_or_else(|| panic!("no nr_reclaimed in {l:?}")), n + 1)
    })
}

/// The cgroup v2 ID of a live process, from procfs and the cgroup2 mount alone: the inode of its
/// directory (`0::PATH` of `/proc/PID/cgroup` under the `cgroup2` mount of `/proc/self/mountinfo`),
/// which is what `bpf_get_current_cgroup_id` returns.
fn cgroup_v2_id(pid: u32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let path = cg.lines().find_map(|l| l.strip_prefix("0::")).expect("a cgroup v2 line in /proc/PID/cgroup");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mount = mounts
        .lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            (post.split(' ').next() == Some("cgroup2")).then(|| pre.split(' ').nth(4).unwrap().to_string())
        })
        .expect("a cgroup2 mount in /proc/self/mountinfo");
    let dir = format!("{mount}{}", path.trim_end_matches('/'));
    std::fs::metadata(&dir).unwrap_or_else(|e| panic!("{dir}: {e}")).ino()
}

/// Global direct reclaim by another application, bounded and restored, on cgroup v1 and v2 alike
/// (global reclaim is not a cgroup matter; the group only makes the model's pages the oldest of
/// one LRU). The model is read into a memory cgroup with no limit; then a `dd` in the same group
/// reads a sparse file of the free memory plus 4 GB (page cache of holes: no disk I/O, all of it
/// reclaimable). kswapd is starved for the read (`testkit::kswapd::Starved`: `SCHED_IDLE`, bound
/// to a CPU that a nice −20 spinner keeps busy, restored after, also after a SIGKILL), and `dd`
/// runs on the other CPUs at nice −20: the free memory falls from the low to the min watermark
/// faster than kswapd reclaims, idle machine or loaded, and `dd` reclaims for its own allocations.
/// Global reclaim scans each group's LRU in proportion to its size, and this group's (the largest
/// on the machine once `dd` has filled it) has the model's pages at its tail: they go first. `dd`
/// is stopped once it has evicted half of the model (or when its file ends), and the sparse file
/// is deleted.
///
/// The `direct_reclaim` rows of `dd`'s pid and comm must be `fincore`'s delta less the other
/// actors' pages (kswapd still runs a little, other processes reclaim too), within
/// `/proc/vmstat`'s `pgsteal_direct` delta, and within the pages `dd`'s own direct reclaims freed
/// (ftrace `vmscan:mm_vmscan_direct_reclaim_end`, `nr_reclaimed`, for its pid). While `dd` lives,
/// its row's memory cgroup must be the group the test made (`/proc/PID/cgroup` as the test's own
/// `cat` in the group reads it: the v1 `memory` line or the v2 line), and its cgroup v2 ID the
/// inode of its v2 cgroup directory.
#[test]
fn global_direct_reclaim_is_blamed_on_the_allocating_process() {
    let _l = machine_lock();
    // The host's own DAMON pageout scheme (page cache left untouched for a minute, on this VM)
    // takes the model's pages when a slowed dd takes longer than that to reach them (a CI run
    // beside the vmtest guest: 0 of 26 861 in 60.8 s): every kdamond is off during the test and
    // back on after, as it was.
    let damon = testkit::damon::Damon::paused().expect("pausing the host's DAMON");
    let dir = scratch_dir("evict");
    let path = write_model(&dir.join("direct.gguf"), 8, 16, 512, 32);
    drop_from_cache(&path);
    let cg = testkit::MemCgroup::new("evict-direct", 64 << 30).expect("memory cgroup");
    let (memcg_path, described) = (cg.proc_path().expect("the group's path in /proc/PID/cgroup"), cg.describe());
    let argv = cg.wrap(&["dd", &format!("if={}", path.display()), "of=/dev/null", "bs=1M", "status=none"]);
    run(&argv.iter().map(String::as_str).collect::<Vec<_>>());
    let sparse = dir.join("direct.sparse");
    let b = Blame::attach(&path);
    let m0 = b.mark();
    assert!(m0.resident > 10_000, "the model should be cached: {} pages", m0.resident);
    let ftrace = TraceInstance::new("moe-observer-evict-direct", "vmscan/mm_vmscan_direct_reclaim_end");
    let starved = testkit::kswapd::Starved::new().expect("starving kswapd");
    // 4 GB beyond the free memory: room for memory others free meanwhile (a run with 1 GB: dd's
    // file ended after 4421 model pages).
    let size = mem_free() + (4 << 30);
    std::fs::File::create(&sparse).unwrap().set_len(size).unwrap();
    let steal0 = testkit::vmstat("pgsteal_direct").expect("pgsteal_direct in /proc/vmstat");
    let cpus = starved.allocator_cpus();
    let argv = cg.wrap(&[
        "taskset",
        "-c",
        &cpus,
        "nice",
        "-n",
        "-20",
        "dd",
        &format!("if={}", sparse.display()),
        "of=/dev/null",
        "bs=1M",
        "status=none",
    ]);
    let mut reader = Command::new(&argv[0]);
    reader.args(&argv[1..]);
    // SAFETY: only an async-signal-safe prctl between fork and exec: dd dies with the test, also
    // with a SIGKILL of it (the death signal is kept across the execs of sh, taskset and nice).
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut reader, || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut reader = reader.spawn().expect("spawn dd");
    let pid = reader.id();
    let direct = |r: &ActorRow| r.kind == "direct_reclaim" && r.pid == pid && r.comm == "dd";
    let t = Instant::now();
    let mut live_row = None;
    let (seen, ended) = loop {
        std::thread::sleep(Duration::from_millis(50));
        let d = b.churn.blame().unwrap().unwrap().since(&m0.table);
        let seen = d.pages_where(direct);
        if seen > 0 && live_row.is_none() {
            // Its cgroups as procfs says while it lives, beside the row.
            let row = d.rows.iter().find(|r| direct(r)).cloned().unwrap();
            live_row = Some((row, cgroup_v2_id(pid)));
        }
        if seen >= m0.resident / 2 {
            break (seen, None);
        }
        if let Some(st) = reader.try_wait().unwrap() {
            break (seen, Some(st));
        }
    };
    let _ = reader.kill();
    let _ = reader.wait();
    drop(starved);
    std::fs::remove_file(&sparse).unwrap();
    let m1 = b.mark();
    let steal1 = testkit::vmstat("pgsteal_direct").unwrap();
    let trace = ftrace.text();
    drop(ftrace);
    drop(cg);
    let (freed, calls) = direct_reclaimed_by(&trace, pid);
    let paused = damon.as_ref().is_some_and(|d| d.any_was_on());
    if let Some(d) = damon {
        d.restore().expect("the host's DAMON put back as it was");
    }
    eprintln!(
        "dd (pid {pid}, CPUs {cpus}) direct-reclaimed {seen} model pages in {:?} (reader {ended:?}); pgsteal_direct \
         +{}; its {calls} direct reclaims freed {freed} pages (ftrace); the host's DAMON {}",
        t.elapsed(),
        steal1 - steal0,
        if paused { "paused meanwhile" } else { "was off" }
    );
    if let Some(st) = ended {
        assert!(
            st.success(),
            "the reader `{}` failed ({st}) before direct reclaim took half the model",
            argv.join(" ")
        );
    }
    assert!(
        seen >= 1000,
        "dd read {size} bytes of holes with kswapd starved and direct-reclaimed only {seen} of the model's {} pages \
         (pgsteal_direct +{}, {calls} direct reclaims of dd in ftrace): the machine did not direct-reclaim the model",
        m0.resident,
        steal1 - steal0
    );
    let named = b.check_rows(&m0, &m1, direct);
    assert!(
        named <= steal1 - steal0,
        "blamed {named} pages on dd's direct reclaim, more than pgsteal_direct +{}",
        steal1 - steal0
    );
    assert!(calls > 0, "ftrace saw no direct reclaim by dd (pid {pid})");
    assert!(
        named <= freed,
        "blamed {named} pages on dd's direct reclaim, more than its reclaims freed ({freed}, ftrace)"
    );
    let (row, v2_id) = live_row.expect("dd's row while it lived");
    eprintln!(
        "dd's row: memcg {:?}, cgroup v2 id {}; the test's group {memcg_path:?}, id {v2_id}",
        row.memcg, row.cgroup_v2
    );
    assert_eq!(row.memcg.as_deref(), Some(memcg_path.as_str()), "dd's memory cgroup ({described})");
    assert_eq!(row.cgroup_v2, v2_id, "dd's cgroup v2 ID against the inode of its v2 cgroup directory");
}
