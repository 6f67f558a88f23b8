//! DAMON for tests: a `pageout` kdamond of the test's own, made through
//! `/sys/kernel/mm/damon/admin`, with every kdamond that was there before put back as it was.
//!
//! ## Rule
//! The kernel changes `kdamonds/nr_kdamonds` only while no kdamond runs (else `EBUSY`), and a
//! change rebuilds every kdamond directory empty. So [`Damon::pageout`]:
//! 1. saves each existing kdamond: every writable file under `kdamonds/N/` except `state`, in an
//!    order that can be written back (in each directory its `nr_*` files, which create the
//!    numbered subdirectories, then its other files, then its subdirectories), and its `state`;
//! 2. turns the running ones off, writes `nr_kdamonds` + 1, writes the saved files back into the
//!    old ones and configures the new one (the last), turns the old ones back on first (so they
//!    keep their `kdamond.N` thread names), then the new one.
//!
//! [`Damon::restore`], and drop on every other path (a failed set-up, a panicking test), turns
//! every kdamond off, writes the old `nr_kdamonds`, writes the saved files back, turns on the ones
//! that were on, and checks that a new save equals the first one. The old kdamonds restart with
//! the same configuration; what they had learned while running (region ages) starts again.
//!
//! ## Surviving a SIGKILL
//! Before it changes anything, [`Damon::pageout`] writes what it saved to [`STATE_FILE`] (under
//! `/run`, a tmpfs: a reboot clears it and DAMON alike); a restore that checked equal removes it.
//! A guard killed with SIGKILL (or a crash) leaves the file, and [`recover`], which every
//! [`Damon::pageout`] calls first (and `cargo xtask setup`), puts the tree back from it. Format:
//! a line `nr_kdamonds N`, then per kdamond a line `kdamond I on|off` and a line
//! `file<TAB>PATH<TAB>VALUE` per saved file, `VALUE` with `\`, newline and tab escaped as `\\`,
//! `\n`, `\t`.
//!
//! [`Damon::paused`] saves the tree the same way and turns every kdamond off; its restore is the
//! same as above (for a test that the host's own pageout scheme would disturb).
//!
//! The new kdamond monitors physical addresses (`paddr`) over the given ranges only, and pages
//! out what was not accessed in one aggregation interval, restricted by two operation filters to
//! non-anonymous folios charged to one memory cgroup (`memcg_path`, the path inside the memory
//! controller's hierarchy, as `/proc/PID/cgroup` shows it), so that it touches nothing else.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};

const ADMIN: &str = "/sys/kernel/mm/damon/admin/kdamonds";
/// What a live guard saved (module doc, "Surviving a SIGKILL").
pub const STATE_FILE: &str = "/run/moe-observer-tests/damon-saved";

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n").replace('\t', "\\t")
}

fn unescape(v: &str) -> Result<String> {
    let mut out = String::with_capacity(v.len());
    let mut it = v.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('\\') => out.push('\\'),
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            other => bail!("{STATE_FILE}: bad escape \\{other:?} in {v:?}"),
        }
    }
    Ok(out)
}

fn encode(saved: &[Saved]) -> String {
    let mut s = format!("nr_kdamonds {}\n", saved.len());
    for (i, k) in saved.iter().enumerate() {
        s += &format!("kdamond {i} {}\n", if k.on { "on" } else { "off" });
        for (p, v) in &k.files {
            s += &format!("file\t{}\t{}\n", escape(&p.to_string_lossy()), escape(v));
        }
    }
    s
}

fn decode(text: &str) -> Result<Vec<Saved>> {
    let mut lines = text.lines();
    let n: usize = lines
        .next()
        .and_then(|l| l.strip_prefix("nr_kdamonds "))
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("{STATE_FILE}: no `nr_kdamonds N` first line"))?;
    let mut saved: Vec<Saved> = Vec::new();
    for l in lines {
        if let Some(rest) = l.strip_prefix("kdamond ") {
            let on = match rest.split_once(' ') {
                Some((i, st)) if i.parse() == Ok(saved.len()) && (st == "on" || st == "off") => st == "on",
                _ => bail!("{STATE_FILE}: bad line {l:?}"),
            };
            saved.push(Saved { files: Vec::new(), on });
        } else if let Some(rest) = l.strip_prefix("file\t") {
            let (p, v) = rest.split_once('\t').with_context(|| format!("{STATE_FILE}: bad line {l:?}"))?;
            let k = saved.last_mut().with_context(|| format!("{STATE_FILE}: a file before any kdamond"))?;
            k.files.push((PathBuf::from(unescape(p)?), unescape(v)?));
        } else {
            bail!("{STATE_FILE}: bad line {l:?}");
        }
    }
    ensure!(saved.len() == n, "{STATE_FILE}: {} kdamonds listed, nr_kdamonds {n}", saved.len());
    Ok(saved)
}

/// Puts the admin tree back from the [`STATE_FILE`] a killed guard left, checks it, and removes
/// the file; `false` when there was none.
pub fn recover() -> Result<bool> {
    let text = match std::fs::read_to_string(STATE_FILE) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("reading {STATE_FILE}")),
    };
    let saved = decode(&text)?;
    eprintln!("testkit::damon: {STATE_FILE} was left by a guard that did not finish: restoring the DAMON admin tree");
    let mut d = Damon { admin: PathBuf::from(ADMIN), saved, ours: None, touched: true, restored: true };
    d.restore_tree().with_context(|| format!("restoring {ADMIN} from {STATE_FILE}"))?;
    Ok(true)
}

/// The admin tree's kdamonds as a guard saves them (compare two to see a change).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot(Vec<Saved>);

/// The admin tree now.
pub fn snapshot() -> Result<Snapshot> {
    let admin = PathBuf::from(ADMIN);
    let n: usize = read(&admin.join("nr_kdamonds"))?.parse().context("nr_kdamonds")?;
    Ok(Snapshot((0..n).map(|i| save(&admin.join(i.to_string()))).collect::<Result<Vec<_>>>()?))
}

/// One saved kdamond: writable files (relative path, value) in write-back order, and its state.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Saved {
    files: Vec<(PathBuf, String)>,
    on: bool,
}

/// The writable files under `dir` (relative to `root`), in write-back order, `state` left out.
fn save_dir(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, String)>) -> Result<()> {
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let e = e?;
        let ty = e.file_type()?;
        if ty.is_dir() {
            dirs.push(e.path());
        } else if ty.is_file() {
            use std::os::unix::fs::PermissionsExt;
            let writable = e.metadata()?.permissions().mode() & 0o200 != 0;
            let name = e.file_name().to_string_lossy().into_owned();
            if writable && !(dir == root && name == "state") {
                files.push((!name.starts_with("nr_"), e.path()));
            }
        }
    }
    files.sort();
    dirs.sort_by_key(|d| {
        let n = d.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        (n.parse::<u64>().unwrap_or(u64::MAX), n)
    });
    for (_, p) in files {
        let v = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        out.push((p.strip_prefix(root).expect("under root").to_owned(), v));
    }
    for d in dirs {
        save_dir(root, &d, out)?;
    }
    Ok(())
}

fn save(kdamond: &Path) -> Result<Saved> {
    let mut files = Vec::new();
    save_dir(kdamond, kdamond, &mut files)?;
    let on = read(&kdamond.join("state"))? == "on";
    Ok(Saved { files, on })
}

fn read(p: &Path) -> Result<String> {
    Ok(std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?.trim().to_string())
}

fn write(p: &Path, v: &str) -> Result<()> {
    std::fs::write(p, v).with_context(|| format!("writing {:?} to {}", v.trim(), p.display()))
}

/// Write a value as it was read: without the newline `show` adds (a string file such as
/// `memcg_path` keeps what is written, newline included); an empty string as a NUL byte (a write
/// of no bytes never reaches the kernel's store).
fn write_back(p: &Path, shown: &str) -> Result<()> {
    let v = shown.strip_suffix('\n').unwrap_or(shown);
    std::fs::write(p, if v.is_empty() { "\0" } else { v })
        .with_context(|| format!("writing {v:?} back to {}", p.display()))
}

fn set_state(kdamond: &Path, on: bool) -> Result<()> {
    let want = if on { "on" } else { "off" };
    if read(&kdamond.join("state"))? != want {
        write(&kdamond.join("state"), want)?;
    }
    Ok(())
}

/// What the test's kdamond does (see the module doc).
#[derive(Debug, Clone)]
pub struct PageoutScheme {
    /// Physical address ranges `[start, end)` to monitor, sorted, not overlapping.
    pub regions: Vec<(u64, u64)>,
    /// Memory cgroup path (`/proc/PID/cgroup` form) whose folios may be paged out.
    pub memcg_path: String,
    pub sample: Duration,
    pub aggregation: Duration,
}

/// The test's kdamond; the admin tree is restored on [`Damon::restore`] or drop.
#[derive(Debug)]
pub struct Damon {
    admin: PathBuf,
    saved: Vec<Saved>,
    /// Index of the test's kdamond, once `nr_kdamonds` was raised.
    ours: Option<usize>,
    /// A kdamond was turned off or the tree written: the restore writes it back.
    touched: bool,
    restored: bool,
}

impl Damon {
    /// Saves the admin tree and starts the test's `pageout` kdamond (module doc).
    pub fn pageout(scheme: &PageoutScheme) -> Result<Damon> {
        let admin = PathBuf::from(ADMIN);
        if !admin.join("nr_kdamonds").exists() {
            bail!(
                "{ADMIN}/nr_kdamonds not found: this kernel has no DAMON sysfs interface (CONFIG_DAMON_SYSFS, with \
                 CONFIG_DAMON_PADDR); a DAMON test needs it"
            );
        }
        ensure!(!scheme.regions.is_empty(), "a DAMON scheme needs at least one physical address range");
        let mut d = Damon::saved(admin)?;
        d.start(scheme)?;
        Ok(d)
    }

    /// Saves the admin tree and turns every kdamond off, for a test that the host's own DAMON
    /// schemes would disturb (a `pageout` of page cache left untouched for a minute); the drop
    /// or [`Damon::restore`] turns back on those that were on, configured as before. `None` on a
    /// kernel without DAMON's sysfs interface: no kdamond runs there to turn off.
    pub fn paused() -> Result<Option<Damon>> {
        let admin = PathBuf::from(ADMIN);
        if !admin.join("nr_kdamonds").exists() {
            return Ok(None);
        }
        let mut d = Damon::saved(admin)?;
        d.touched = true;
        d.all_off()?;
        Ok(Some(d))
    }

    /// Whether any kdamond was on when the tree was saved.
    pub fn any_was_on(&self) -> bool {
        self.saved.iter().any(|s| s.on)
    }

    /// The tree under `admin` saved, in memory and in [`STATE_FILE`] (module doc), nothing changed.
    fn saved(admin: PathBuf) -> Result<Damon> {
        recover()?;
        let n: usize = read(&admin.join("nr_kdamonds"))?.parse().context("nr_kdamonds")?;
        let saved = (0..n).map(|i| save(&admin.join(i.to_string()))).collect::<Result<Vec<_>>>()?;
        let state = Path::new(STATE_FILE);
        std::fs::create_dir_all(state.parent().expect("a directory"))
            .with_context(|| format!("making the directory of {STATE_FILE}"))?;
        std::fs::write(state, encode(&saved)).with_context(|| format!("writing {STATE_FILE}"))?;
        Ok(Damon { admin, saved, ours: None, touched: false, restored: false })
    }

    fn kdamond(&self, i: usize) -> PathBuf {
        self.admin.join(i.to_string())
    }

    fn put_back(&self) -> Result<()> {
        for (i, s) in self.saved.iter().enumerate() {
            let k = self.kdamond(i);
            for (p, v) in &s.files {
                write_back(&k.join(p), v)?;
            }
        }
        for (i, s) in self.saved.iter().enumerate() {
            if s.on {
                set_state(&self.kdamond(i), true)?;
            }
        }
        Ok(())
    }

    fn all_off(&self) -> Result<()> {
        let n: usize = read(&self.admin.join("nr_kdamonds"))?.parse().context("nr_kdamonds")?;
        for i in 0..n {
            set_state(&self.kdamond(i), false)?;
        }
        Ok(())
    }

    fn start(&mut self, scheme: &PageoutScheme) -> Result<()> {
        self.touched = true;
        self.all_off()?;
        let ours = self.saved.len();
        write(&self.admin.join("nr_kdamonds"), &(ours + 1).to_string())?;
        self.ours = Some(ours);
        self.put_back()?;
        let k = self.kdamond(ours);
        let ctx = k.join("contexts/0");
        write(&k.join("contexts/nr_contexts"), "1")?;
        let ops = read(&ctx.join("avail_operations"))?;
        if !ops.split_whitespace().any(|o| o == "paddr") {
            bail!("DAMON offers operations [{ops}] without paddr (CONFIG_DAMON_PADDR): the test's scheme needs it");
        }
        write(&ctx.join("operations"), "paddr")?;
        let iv = ctx.join("monitoring_attrs/intervals");
        write(&iv.join("sample_us"), &scheme.sample.as_micros().to_string())?;
        write(&iv.join("aggr_us"), &scheme.aggregation.as_micros().to_string())?;
        write(&iv.join("update_us"), &scheme.aggregation.as_micros().to_string())?;
        write(&ctx.join("targets/nr_targets"), "1")?;
        let regions = ctx.join("targets/0/regions");
        write(&regions.join("nr_regions"), &scheme.regions.len().to_string())?;
        for (i, (s, e)) in scheme.regions.iter().enumerate() {
            write(&regions.join(format!("{i}/start")), &s.to_string())?;
            write(&regions.join(format!("{i}/end")), &e.to_string())?;
        }
        write(&ctx.join("schemes/nr_schemes"), "1")?;
        let s = ctx.join("schemes/0");
        write(&s.join("action"), "pageout")?;
        let ap = s.join("access_pattern");
        for (f, v) in [
            ("sz/min", "0".to_string()),
            ("sz/max", u64::MAX.to_string()),
            ("nr_accesses/min", "0".into()),
            ("nr_accesses/max", "0".into()),
            ("age/min", "0".into()),
            ("age/max", u32::MAX.to_string()),
        ] {
            write(&ap.join(f), &v)?;
        }
        // Operation filters (`ops_filters` since Linux 6.15, `filters` before).
        let filters = if s.join("ops_filters").exists() { s.join("ops_filters") } else { s.join("filters") };
        write(&filters.join("nr_filters"), "2")?;
        for (i, ty, allow) in [(0, "anon", "N"), (1, "memcg", "Y")] {
            let f = filters.join(i.to_string());
            write(&f.join("type"), ty)?;
            if ty == "memcg" {
                write(&f.join("memcg_path"), &scheme.memcg_path)?;
            }
            write(&f.join("matching"), "Y")?;
            if f.join("allow").exists() {
                write(&f.join("allow"), allow)?;
            } else if allow == "Y" {
                // Before 6.14 a filter only rejects: reject what is not in the memcg instead.
                write(&f.join("matching"), "N")?;
            }
        }
        set_state(&k, true)
    }

    /// PID of the test's kdamond.
    pub fn pid(&self) -> Result<u32> {
        let k = self.kdamond(self.ours.context("not started")?);
        read(&k.join("pid"))?.parse().context("kdamond pid")
    }

    /// Bytes the test's scheme paged out (`stats/sz_applied`, refreshed by `update_schemes_stats`).
    pub fn applied_bytes(&self) -> Result<u64> {
        let k = self.kdamond(self.ours.context("not started")?);
        write(&k.join("state"), "update_schemes_stats")?;
        read(&k.join("contexts/0/schemes/0/stats/sz_applied"))?.parse().context("sz_applied")
    }

    /// Turns the test's kdamond off (it evicts nothing more).
    pub fn stop(&self) -> Result<()> {
        set_state(&self.kdamond(self.ours.context("not started")?), false)
    }

    /// Puts the admin tree back and checks it equals what was saved.
    pub fn restore(mut self) -> Result<()> {
        self.restored = true;
        self.restore_tree()
    }

    fn restore_tree(&mut self) -> Result<()> {
        if self.touched {
            self.all_off()?;
            write(&self.admin.join("nr_kdamonds"), &self.saved.len().to_string())?;
            self.ours = None;
            self.put_back()?;
            self.touched = false;
        }
        for (i, s) in self.saved.iter().enumerate() {
            let now = save(&self.kdamond(i))?;
            let differ: Vec<String> = now
                .files
                .iter()
                .zip(&s.files)
                .filter(|(a, b)| a != b)
                .map(|(a, b)| format!("{}: {:?} (was {:?})", a.0.display(), a.1, b.1))
                .collect();
            ensure!(
                now.on == s.on && now.files.len() == s.files.len() && differ.is_empty(),
                "kdamond {i} after the restore differs from before: state on {} (was {}), {} files (were {}); {}",
                now.on,
                s.on,
                now.files.len(),
                s.files.len(),
                differ.join("; ")
            );
        }
        match std::fs::remove_file(STATE_FILE) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("removing {STATE_FILE}"))
            }
            _ => Ok(()),
        }
    }
}

impl Drop for Damon {
    fn drop(&mut self) {
        if !self.restored
            && let Err(e) = self.restore_tree()
        {
            eprintln!("testkit::Damon: restoring {ADMIN} failed: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_file_reads_back_what_was_written() {
        let saved = vec![
            Saved {
                files: vec![
                    (PathBuf::from("contexts/nr_contexts"), "1\n".into()),
                    (PathBuf::from("contexts/0/schemes/0/filters/0/memcg_path"), "/a\tb\\c\n\n".into()),
                    (PathBuf::from("refresh_ms"), "".into()),
                ],
                on: true,
            },
            Saved { files: vec![], on: false },
        ];
        let text = encode(&saved);
        assert_eq!(decode(&text).unwrap(), saved);
        assert!(decode("nr_kdamonds 3\nkdamond 0 on\n").is_err(), "a count that disagrees");
        assert!(decode("nr_kdamonds 1\nkdamond 0 on\nfile\tx\t\\q\n").is_err(), "a bad escape");
    }

    #[test]
    fn a_save_writes_counts_before_files_before_subdirectories_and_skips_read_only_files() {
        use std::os::unix::fs::PermissionsExt;
        let root = std::env::temp_dir().join(format!("testkit-damon-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for d in ["contexts/0/targets/0", "contexts/10"] {
            std::fs::create_dir_all(root.join(d)).unwrap();
        }
        for (f, v, mode) in [
            ("state", "on\n", 0o600),
            ("pid", "79\n", 0o400),
            ("refresh_ms", "0\n", 0o600),
            ("contexts/nr_contexts", "1\n", 0o600),
            ("contexts/0/operations", "paddr\n", 0o600),
            ("contexts/0/avail_operations", "paddr\n", 0o400),
            ("contexts/0/targets/nr_targets", "1\n", 0o600),
            ("contexts/0/targets/0/pid_target", "0\n", 0o600),
        ] {
            std::fs::write(root.join(f), v).unwrap();
            std::fs::set_permissions(root.join(f), std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let s = save(&root).unwrap();
        let got: Vec<&str> = s.files.iter().map(|(p, _)| p.to_str().unwrap()).collect();
        assert_eq!(
            got,
            [
                "refresh_ms",
                "contexts/nr_contexts",
                "contexts/0/operations",
                "contexts/0/targets/nr_targets",
                "contexts/0/targets/0/pid_target",
            ]
        );
        assert!(s.on);
        assert_eq!(s.files[2].1, "paddr\n");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
