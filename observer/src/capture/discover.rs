//! Discovery for `observer serve --discover`: which processes on this host are
//! engines to follow, and the labels their series would carry.
//!
//! ## Spec
//! - A process is a target when it maps a `.gguf` file (any mapping in
//!   `/proc/PID/maps` whose path ends in `.gguf`, deleted or not), or when its
//!   executable defines our token markers ([`moe_abi::markers::SYM_BEGIN`]).
//!   A process that maps a library of a known engine profile is a target too,
//!   GGUF or not ([`engine_of`]).
//! - Labels are bounded and stable, never a PID or a TID:
//!   - `engine`: `moe-engine` (our markers), the name of the first engine
//!     profile (`capture::profile`, e.g. `llama.cpp`) whose entry points a file
//!     it maps executable defines, else `gguf` (an unknown program mapping a
//!     GGUF file);
//!   - `model`: the file name of the first `.gguf` it maps (empty if none).
//!     Paths in `/proc/PID/maps` are in the process's own root, so a model in a
//!     container is named as the container sees it, never by a host path;
//!   - `container`: the container id (first 12 hex digits) found in the last
//!     component of its cgroup v2 path (`docker-ID.scope`,
//!     `cri-containerd-ID.scope`, `libpod-ID.scope`, `crio-ID.scope`, a bare
//!     64-digit id), else empty (the host).
//! - [`Discovery`] keeps at most `limit` distinct label sets; a target with a
//!   new label set beyond that is not followed and is counted in
//!   [`Discovery::dropped`].
//! - A process is classified when first seen (keyed by PID and start time),
//!   so a scan costs a `/proc` listing, each process's `stat`, and the
//!   classification of the new ones. A process found not to be a target is
//!   classified again when its `comm` changed (an `exec`: a wrapper such as
//!   `sh -c`, `env` or `taskset` that becomes the engine keeps its PID and
//!   start time) or, at most every [`RECLASSIFY_EVERY`], when its virtual size
//!   changed (it mapped something: a Python program that loads an engine
//!   library and then its model). A target found before it mapped a `.gguf`
//!   file (an engine found by its markers or profile while it loads) has its
//!   mappings read again at each
//!   scan until one appears, and from then on carries that `model` label (a
//!   new label set, within the limit; at the limit it keeps its old one).
//!   So that a starting engine is not first labelled `model=""` for the few
//!   milliseconds before it maps its model, a target without a model is only
//!   reported once it is [`MODEL_GRACE`] old.
//! - A `/proc` that cannot be listed is an error naming it (not a host without
//!   engines); what was seen is kept for the next scan.

use std::{
    collections::{BTreeSet, HashMap, hash_map::Entry},
    path::Path,
    time::Duration,
};

use super::profile::{self, Profile};

/// How old a target without a model must be to be reported (module spec).
pub const MODEL_GRACE: Duration = Duration::from_millis(500);
/// How often a non-target whose virtual size keeps changing is classified again (module spec).
pub const RECLASSIFY_EVERY: Duration = Duration::from_secs(1);

/// The labels of a discovered target.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Labels {
    pub engine: &'static str,
    pub model: String,
    pub container: String,
}

/// A discovered process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub pid: u32,
    /// Start time in clock ticks since boot (`/proc/PID/stat` field 22).
    pub start: u64,
    pub labels: Labels,
}

/// A process as its `/proc/PID/stat` shows it at a scan.
#[derive(Debug)]
struct Stat {
    /// Start time in clock ticks since boot: with the PID, the process.
    start: u64,
    /// Its name: changes at `exec`.
    comm: String,
    /// Virtual size in bytes: changes with its mappings.
    vsize: u64,
}

/// A classified process: its labels (None if it is not a target), and what it was when classified.
#[derive(Debug)]
struct Seen {
    labels: Option<Labels>,
    was: Stat,
    at: std::time::Instant,
}

impl Seen {
    /// A non-target to classify again (module spec): it `exec`ed, or it mapped something and was
    /// last classified [`RECLASSIFY_EVERY`] ago.
    fn stale(&self, now: &Stat) -> bool {
        self.labels.is_none()
            && (self.was.comm != now.comm || (self.was.vsize != now.vsize && self.at.elapsed() >= RECLASSIFY_EVERY))
    }
}

/// The state kept between scans.
#[derive(Debug)]
pub struct Discovery {
    limit: usize,
    /// (pid, start) → what it was when classified, and its labels.
    seen: HashMap<(u32, u64), Seen>,
    label_sets: BTreeSet<Labels>,
    dropped: BTreeSet<(u32, u64)>,
}

impl Discovery {
    pub fn new(limit: usize) -> Discovery {
        Discovery { limit, seen: HashMap::new(), label_sets: BTreeSet::new(), dropped: BTreeSet::new() }
    }

    /// The live targets, oldest first (within the cardinality limit); an error naming `/proc`
    /// when it cannot be listed (nothing is forgotten then).
    pub fn scan(&mut self) -> std::io::Result<Vec<Target>> {
        self.scan_listing(Path::new("/proc"))
    }

    /// [`Self::scan`], with the processes listed from `proc` (a test lists a directory that
    /// cannot be read; each process's files are read from `/proc`).
    fn scan_listing(&mut self, proc: &Path) -> std::io::Result<Vec<Target>> {
        let me = std::process::id();
        let mut live: Vec<(u32, Stat)> = Vec::new();
        let dir = std::fs::read_dir(proc)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot list {}: {e}", proc.display())))?;
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if pid == me {
                continue;
            }
            let Some(stat) = stat(pid) else { continue };
            live.push((pid, stat));
        }
        let alive: BTreeSet<(u32, u64)> = live.iter().map(|(pid, s)| (*pid, s.start)).collect();
        self.seen.retain(|k, _| alive.contains(k));
        self.dropped.retain(|k| alive.contains(k));
        let mut out = Vec::new();
        for (pid, now) in live {
            let start = now.start;
            let entry = match self.seen.entry((pid, start)) {
                Entry::Occupied(e) if !e.get().stale(&now) => e.into_mut(),
                e => {
                    let labels = classify(pid);
                    if labels.as_ref().is_some_and(|l| l.model.is_empty()) && age(start) < MODEL_GRACE {
                        continue; // looked at again at the next scan
                    }
                    e.insert_entry(Seen { labels, was: now, at: std::time::Instant::now() }).into_mut()
                }
            };
            if let Some(l) = entry.labels.as_mut().filter(|l| l.model.is_empty()) {
                let model = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok().and_then(|m| gguf_of_maps(&m));
                if let Some(model) = model {
                    let new = Labels { model, ..l.clone() };
                    if self.label_sets.contains(&new) || self.label_sets.len() < self.limit {
                        *l = new;
                    }
                }
            }
            let Some(labels) = entry.labels.clone() else { continue };
            if !self.label_sets.contains(&labels) {
                if self.label_sets.len() >= self.limit {
                    if self.dropped.insert((pid, start)) {
                        log::warn!(
                            "serve: pid {pid} ({} {:?}) is not followed: the limit of {} label sets is reached (--max-targets)",
                            labels.engine,
                            labels.model,
                            self.limit
                        );
                    }
                    continue;
                }
                self.label_sets.insert(labels.clone());
            }
            out.push(Target { pid, start, labels });
        }
        out.sort_by_key(|t| (t.start, t.pid));
        Ok(out)
    }

    /// Targets not followed because of the limit, among the live ones.
    pub fn dropped(&self) -> usize {
        self.dropped.len()
    }
}

/// How long ago a process started, from its start time in clock ticks since boot.
fn age(start_ticks: u64) -> Duration {
    use procfs::Current;
    let up = procfs::Uptime::current().map(|u| u.uptime).unwrap_or(f64::MAX);
    let started = start_ticks as f64 / procfs::ticks_per_second() as f64;
    Duration::try_from_secs_f64(up - started).unwrap_or(Duration::ZERO)
}

/// `/proc/PID/stat` of a live process (not a zombie).
fn stat(pid: u32) -> Option<Stat> {
    let s = procfs::process::Process::new(pid as i32).and_then(|p| p.stat()).ok()?;
    (!matches!(s.state, 'Z' | 'X')).then_some(Stat { start: s.starttime, comm: s.comm, vsize: s.vsize })
}

/// This process's labels if it is a target.
pub fn classify(pid: u32) -> Option<Labels> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let model = gguf_of_maps(&maps);
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    // The executable as this process sees it, reached through its root.
    let exe_file = exe.as_ref().map(|e| Path::new(&format!("/proc/{pid}/root")).join(e.strip_prefix("/").unwrap_or(e)));
    let engine = engine_of(pid, exe_file.as_deref(), &maps, model.is_some())?;
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    Some(Labels { engine, model: model.unwrap_or_default(), container: container_of_cgroup(&cgroup) })
}

/// Which engine a process runs; None if it is not a target (module spec):
/// our markers in its executable, else the first engine profile
/// ([`profile::PROFILES`]) whose entry points a file it maps executable
/// defines (a library loaded with `dlopen` included), else `gguf` when it maps
/// a GGUF file.
pub fn engine_of(pid: u32, exe_file: Option<&Path>, maps: &str, maps_gguf: bool) -> Option<&'static str> {
    if exe_file.is_some_and(has_markers) {
        return Some("moe-engine");
    }
    if let Some(p) = profile_of_maps(pid, maps) {
        return Some(p.name);
    }
    maps_gguf.then_some("gguf")
}

/// Files already looked at for engine profiles, by (device, inode): a host's
/// processes share most of their libraries, so each is parsed once.
static PROFILE_OF_FILE: std::sync::Mutex<Option<ProfileCache>> = std::sync::Mutex::new(None);
type ProfileCache = HashMap<(u64, u64), Option<&'static Profile>>;
/// Bound on [`PROFILE_OF_FILE`] (emptied when full).
const PROFILE_CACHE: usize = 4096;

/// The first engine profile whose entry points an executable mapping of the
/// process defines (files reached through its root).
fn profile_of_maps(pid: u32, maps: &str) -> Option<&'static Profile> {
    use std::os::unix::fs::MetadataExt;
    let profiles: Vec<&'static Profile> = profile::PROFILES.iter().collect();
    let mut cache = PROFILE_OF_FILE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    let mut looked = BTreeSet::new();
    for l in maps.lines() {
        let mut f = l.splitn(6, char::is_whitespace);
        let perms = f.nth(1).unwrap_or("");
        let Some(path) = f.nth(3).map(str::trim_start) else { continue };
        if !perms.contains('x') || !path.starts_with('/') || !looked.insert(path) {
            continue;
        }
        let file = Path::new(&format!("/proc/{pid}/root")).join(path.trim_start_matches('/'));
        let Ok(m) = std::fs::metadata(&file) else { continue };
        let key = (m.dev(), m.ino());
        let found = match cache.get(&key) {
            Some(p) => *p,
            None => {
                if cache.len() >= PROFILE_CACHE {
                    cache.clear();
                }
                let p = profile::profile_of_file(&file, &profiles);
                cache.insert(key, p);
                p
            }
        };
        if found.is_some() {
            return found;
        }
    }
    None
}

/// Whether an executable defines our token markers.
fn has_markers(path: &Path) -> bool {
    use object::{Object, ObjectSymbol};
    let Ok(map) = super::bpf::map_elf(path) else { return false };
    let Ok(file) = object::File::parse(&*map) else { return false };
    let sym = moe_abi::markers::SYM_BEGIN;
    file.symbols().chain(file.dynamic_symbols()).any(|s| s.name() == Ok(sym) && s.is_definition())
}

/// The file name of the first `.gguf` mapping in a `/proc/PID/maps` text.
pub fn gguf_of_maps(maps: &str) -> Option<String> {
    let path = gguf_path_of_maps(maps)?;
    Some(Path::new(&path).file_name()?.to_str()?.to_string())
}

/// The path of the first `.gguf` mapping in a `/proc/PID/maps` text (in the
/// process's own root; ` (deleted)` taken off).
pub fn gguf_path_of_maps(maps: &str) -> Option<String> {
    use procfs::{FromRead, process::MMapPath};
    let maps = procfs::process::MemoryMaps::from_read(maps.as_bytes()).ok()?;
    maps.iter().find_map(|m| {
        let MMapPath::Path(path) = &m.pathname else { return None };
        let path = path.to_str()?;
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        let name = Path::new(path).file_name()?.to_str()?;
        name.to_ascii_lowercase().ends_with(".gguf").then(|| path.to_string())
    })
}

/// The model file a running process has mapped, as this process can open it
/// (through `/proc/PID/root`, so a container's file is found too).
pub fn mapped_gguf(pid: u32) -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let path = gguf_path_of_maps(&maps)?;
    let via_root = Path::new(&format!("/proc/{pid}/root")).join(path.trim_start_matches('/'));
    Some(if Path::new(&path).exists() && same_root(pid) { path.into() } else { via_root })
}

/// Whether process `pid` sees the same root directory as this one.
fn same_root(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(a), Ok(b)) = (std::fs::metadata("/proc/self/root"), std::fs::metadata(format!("/proc/{pid}/root"))) else {
        return false;
    };
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

/// The container id in a `/proc/PID/cgroup` text (its cgroup v2 line), or "".
pub fn container_of_cgroup(cgroup: &str) -> String {
    use procfs::FromRead;
    let groups = procfs::ProcessCGroups::from_read(cgroup.as_bytes()).map(|g| g.0).unwrap_or_default();
    let Some(v2) = groups.iter().find(|g| g.hierarchy == 0 && g.controllers.is_empty()) else { return String::new() };
    for comp in v2.pathname.rsplit('/') {
        let stem = comp.strip_suffix(".scope").unwrap_or(comp);
        let id = stem.rsplit(['-', ':']).next().unwrap_or(stem);
        if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return id[..12].to_string();
        }
    }
    String::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_mappings_are_named_by_file_name() {
        let maps = "\
5581a000-5581b000 r--p 00000000 fd:01 123 /usr/bin/llama-server
7f00-7f10 r--s 00000000 fd:01 456 /models/My Model-Q4_K_M.GGUF (deleted)
7f10-7f20 r--p 00000000 00:00 0 [heap]
";
        assert_eq!(gguf_of_maps(maps).as_deref(), Some("My Model-Q4_K_M.GGUF"));
        assert_eq!(gguf_path_of_maps(maps).as_deref(), Some("/models/My Model-Q4_K_M.GGUF"));
        assert_eq!(gguf_of_maps("7f10-7f20 r--p 00000000 00:00 0 [heap]\n"), None);
        assert_eq!(gguf_of_maps("7f10-7f20 r--p 00000000 fd:01 9 /a/gguf.txt\n"), None);
    }

    #[test]
    fn containers_are_named_by_their_id() {
        let id = "0123456789abcdef".repeat(4);
        for path in [
            format!("/system.slice/docker-{id}.scope"),
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-pod1.slice/cri-containerd-{id}.scope"),
            format!("/machine.slice/libpod-{id}.scope/container"),
            format!("/kubepods/besteffort/pod1/{id}"),
        ] {
            assert_eq!(container_of_cgroup(&format!("0::{path}\n")), "0123456789ab", "{path}");
        }
        assert_eq!(container_of_cgroup("0::/user.slice/user-0.slice/session-1.scope\n"), "");
        assert_eq!(container_of_cgroup("1:memory:/docker/x\n"), "", "cgroup v1 only: no id");
    }

    #[test]
    fn a_process_mapping_a_gguf_file_is_discovered_and_labelled_and_the_limit_holds() {
        let dir = std::env::temp_dir().join(format!("observer-discover-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut children = Vec::new();
        for name in ["a.gguf", "b.gguf"] {
            let f = dir.join(name);
            std::fs::write(&f, [0u8; 4096]).unwrap();
            // python maps the file and waits: an unknown program mapping a GGUF.
            let child = std::process::Command::new("python3")
                .args(["-c", "import mmap,sys,time; f=open(sys.argv[1],'rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); print(flush=True); time.sleep(60)"])
                .arg(&f)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("python3");
            children.push(child);
        }
        for c in &mut children {
            use std::io::Read;
            let mut b = [0u8; 1];
            c.stdout.as_mut().unwrap().read_exact(&mut b).unwrap();
        }
        let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
        let mine = |ts: &[Target]| ts.iter().filter(|t| pids.contains(&t.pid)).cloned().collect::<Vec<_>>();
        let found = mine(&Discovery::new(100).scan().unwrap());
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[0].labels, Labels { engine: "gguf", model: "a.gguf".into(), container: String::new() });
        assert_eq!(found[1].labels.model, "b.gguf");
        // A limit of one label set: the second model is not followed, and counted.
        let mut d = Discovery::new(1);
        let found = mine(&d.scan().unwrap());
        let others = d.scan().unwrap().len();
        assert!(found.len() <= 1 && others <= 1 && d.dropped() >= 1, "{found:?} dropped {}", d.dropped());
        for mut c in children {
            c.kill().unwrap();
            c.wait().unwrap();
        }
        assert!(mine(&Discovery::new(100).scan().unwrap()).is_empty(), "ended processes are gone");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A listing that cannot be read is an error naming it, not a host without engines, and what
    /// was seen is kept for the next scan.
    #[test]
    fn a_proc_that_cannot_be_listed_is_an_error_naming_it() {
        let mut d = Discovery::new(100);
        d.scan().unwrap();
        let seen = d.seen.len();
        assert!(seen > 0, "this test's own process tree is on the host");
        let e = d.scan_listing(Path::new("/nonexistent/proc")).unwrap_err();
        assert!(e.to_string().starts_with("cannot list /nonexistent/proc: "), "{e}");
        assert_eq!(d.seen.len(), seen);
    }

    /// A process seen before it was a target is found once it is one: a wrapper that `exec`s the
    /// engine (same PID and start time, new `comm`), and a program that maps its model later
    /// (same `comm`, new mapping).
    #[test]
    fn a_process_that_becomes_a_target_later_is_discovered() {
        use std::io::{BufRead, BufReader, Write};
        let dir = std::env::temp_dir().join(format!("observer-discover-later-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("later.gguf");
        std::fs::write(&f, [0u8; 4096]).unwrap();
        // Prints a line, waits for one, then maps the file, prints again and waits.
        let python = "import mmap,sys,time; print(flush=True); sys.stdin.readline(); f=open(sys.argv[1],'rb'); \
                      m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); print(flush=True); time.sleep(60)";
        let script = format!("read x; exec python3 -c \"{python}\" \"$1\"");
        let cases: [(&str, Vec<&str>); 2] =
            [("exec", vec!["sh", "-c", &script, "sh"]), ("a later mapping", vec!["python3", "-c", python])];
        for (case, argv) in cases {
            let mut child = std::process::Command::new(argv[0])
                .args(&argv[1..])
                .arg(&f)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("sh and python3");
            let pid = child.id();
            let mut stdin = child.stdin.take().unwrap();
            let mut out = BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            let mine = |ts: Vec<Target>| ts.into_iter().find(|t| t.pid == pid);
            let mut d = Discovery::new(100);
            if case == "exec" {
                // sh waits for its line: not a target.
                std::thread::sleep(Duration::from_millis(100));
                assert_eq!(mine(d.scan().unwrap()), None, "{case}: sh is not a target");
                writeln!(stdin).unwrap();
                out.read_line(&mut line).unwrap();
            } else {
                out.read_line(&mut line).unwrap();
                assert_eq!(mine(d.scan().unwrap()), None, "{case}: python without the file is not a target");
            }
            std::thread::sleep(RECLASSIFY_EVERY);
            writeln!(stdin).unwrap();
            out.read_line(&mut line).unwrap();
            let found = mine(d.scan().unwrap());
            assert_eq!(found.map(|t| t.labels.model), Some("later.gguf".to_string()), "{case}");
            child.kill().unwrap();
            child.wait().unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
