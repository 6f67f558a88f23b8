//! Debian's packages, fetched with Debian's own client into the vmtest cache, never installed.
//!
//! A private apt configuration (`<cache>/vmtest/apt/`: its own sources list, package lists,
//! status file and download directory) reads bookworm, bookworm-security and
//! bookworm-backports for amd64 and arm64, so that nothing on the machine changes (the machine's
//! own apt sources, its installed packages and dpkg's database stay as they were).
//! `apt-get update` runs once, when the lists are missing, or again with `--refresh`. A package's
//! version is the candidate in those lists; its `.deb` is downloaded once into
//! `<cache>/vmtest/debs/` and unpacked once with `dpkg-deb -x` into
//! `<cache>/vmtest/pkgs/<arch>/<name>_<version>/` (a `.complete` file marks a finished unpack), so
//! the cache is keyed by version and a newer candidate lands beside the older one.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use crate::cmd;

const SOURCES: &str = "\
deb [arch=amd64,arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb [arch=amd64,arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
deb [arch=amd64,arm64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main
";

/// One binary package at the version apt chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pkg {
    pub name: String,
    /// Debian's architecture name: `amd64`, `arm64` or `all`.
    pub arch: String,
    pub version: String,
    /// The `Depends:` field as apt prints it.
    pub depends: String,
}

impl Pkg {
    /// `name_version_arch` with the epoch's `:` spelled as apt spells it in file names.
    pub fn key(&self) -> String {
        format!("{}_{}_{}", self.name, self.version.replace(':', "%3a"), self.arch)
    }
}

pub struct Apt {
    root: PathBuf,
}

impl Apt {
    /// The private apt state under `vmtest_dir`; runs `apt-get update` when its lists are missing
    /// or `refresh` is set.
    pub fn open(vmtest_dir: &Path, refresh: bool) -> Result<Apt> {
        if !cmd::on_path("apt-get") || !cmd::on_path("dpkg-deb") {
            bail!("vmtest fetches kernels and QEMU from Debian's archive with apt-get and dpkg-deb: run it on Debian");
        }
        let keyring = Path::new("/usr/share/keyrings/debian-archive-keyring.gpg");
        if !keyring.exists() {
            bail!("{} missing: `apt-get install debian-archive-keyring`", keyring.display());
        }
        let root = vmtest_dir.join("apt");
        for d in ["lists/partial", "archives/partial", "etc/parts", "debs", "pkgs"] {
            let d = if d.starts_with("debs") || d.starts_with("pkgs") { vmtest_dir.join(d) } else { root.join(d) };
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        std::fs::write(root.join("etc/sources.list"), SOURCES).context("writing the private sources.list")?;
        let status = root.join("status");
        if !status.exists() {
            std::fs::write(&status, "").context("writing the private dpkg status file")?;
        }
        let apt = Apt { root };
        let has_lists = std::fs::read_dir(apt.root.join("lists"))?
            .flatten()
            .any(|e| e.file_name().to_string_lossy().contains("bookworm-backports"));
        if refresh || !has_lists {
            quiet(apt.tool("apt-get").arg("update"), "apt-get update (the private vmtest lists)").context(
                "apt-get update of the private vmtest lists failed (deb.debian.org must be reachable; \
                 a warm cache needs no network)",
            )?;
        }
        Ok(apt)
    }

    fn vmtest_dir(&self) -> &Path {
        self.root.parent().expect("the apt dir has a parent")
    }

    /// `apt-get` or `apt-cache` with the private configuration.
    fn tool(&self, name: &str) -> Command {
        let r = &self.root;
        let mut c = Command::new(name);
        for (k, v) in [
            ("Dir::Etc::SourceList", r.join("etc/sources.list")),
            ("Dir::Etc::SourceParts", r.join("etc/parts")),
            ("Dir::Etc::Preferences", PathBuf::from("/dev/null")),
            ("Dir::Etc::PreferencesParts", r.join("etc/parts")),
            ("Dir::State::Lists", r.join("lists")),
            ("Dir::State::status", r.join("status")),
            ("Dir::Cache", r.clone()),
            ("Dir::Cache::archives", r.join("archives")),
        ] {
            c.arg("-o").arg(format!("{k}={}", v.display()));
        }
        c.args(["-o", "APT::Architectures::=amd64", "-o", "APT::Architectures::=arm64"]);
        c.args(["-o", "Acquire::Languages=none", "-o", "APT::Sandbox::User=root", "-q"]);
        c
    }

    /// The candidate of `name` (`name:arch` for another architecture than amd64), from `release`
    /// when given (e.g. `bookworm-backports`).
    pub fn candidate(&self, name: &str, release: Option<&str>) -> Result<Pkg> {
        let mut c = self.tool("apt-cache");
        if let Some(r) = release {
            c.args(["-t", r]);
        }
        let text = cmd::output(c.args(["show", "--no-all-versions", name]))
            .with_context(|| format!("Debian has no package {name} in the vmtest lists (try --refresh)"))?;
        let field = |f: &str| text.lines().find_map(|l| l.strip_prefix(f)).map(|v| v.trim().to_string());
        Ok(Pkg {
            name: field("Package:").with_context(|| format!("apt-cache show {name}: no Package field"))?,
            arch: field("Architecture:").with_context(|| format!("apt-cache show {name}: no Architecture"))?,
            version: field("Version:").with_context(|| format!("apt-cache show {name}: no Version field"))?,
            depends: field("Depends:").unwrap_or_default(),
        })
    }

    /// The package a meta-package pins exactly (`Depends: linux-image-X (= V)`), e.g. the kernel
    /// image behind `linux-image-cloud-amd64`.
    pub fn resolve_meta(&self, meta: &str, release: Option<&str>) -> Result<Pkg> {
        let m = self.candidate(meta, release)?;
        let dep = m
            .depends
            .split(',')
            .map(str::trim)
            .find(|d| d.contains("(= "))
            .with_context(|| format!("{meta} {} pins no exact package: Depends: {}", m.version, m.depends))?;
        let name = dep.split_whitespace().next().unwrap_or_default();
        let qualified =
            if m.arch == "amd64" || m.arch == "all" { name.to_string() } else { format!("{name}:{}", m.arch) };
        self.candidate(&qualified, release)
    }

    /// The `.deb` of `p`, downloaded once.
    pub fn deb(&self, p: &Pkg) -> Result<PathBuf> {
        let dir = self.vmtest_dir().join("debs");
        let file = dir.join(format!("{}.deb", p.key()));
        if !file.exists() {
            let spec = if p.arch == "amd64" || p.arch == "all" {
                format!("{}={}", p.name, p.version)
            } else {
                format!("{}:{}={}", p.name, p.arch, p.version)
            };
            quiet(
                self.tool("apt-get").current_dir(&dir).args(["download", &spec]),
                &format!("apt-get download {spec}"),
            )
            .with_context(|| format!("downloading {spec} from Debian"))?;
            if !file.exists() {
                bail!("apt-get download {spec} left no {}", file.display());
            }
        }
        Ok(file)
    }

    /// `p` unpacked (once) into its own directory under `pkgs/<arch>/`.
    pub fn unpacked(&self, p: &Pkg) -> Result<PathBuf> {
        let dir = self.vmtest_dir().join("pkgs").join(&p.arch).join(p.key());
        if !dir.join(".complete").exists() {
            let deb = self.deb(p)?;
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)?;
            quiet(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&dir), &format!("unpacking {}", p.key()))
                .with_context(|| format!("unpacking {}", deb.display()))?;
            std::fs::write(dir.join(".complete"), "")?;
        }
        Ok(dir)
    }

    /// `p` unpacked into `root`, a tree several packages share (e.g. QEMU and its libraries);
    /// `root/.pkgs/KEY` marks each package unpacked there.
    pub fn unpack_into(&self, p: &Pkg, root: &Path) -> Result<()> {
        let mark = root.join(".pkgs").join(p.key());
        if mark.exists() {
            return Ok(());
        }
        let deb = self.deb(p)?;
        std::fs::create_dir_all(mark.parent().expect("a parent"))?;
        quiet(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(root), &format!("unpacking {}", p.key()))
            .with_context(|| format!("unpacking {} into {}", deb.display(), root.display()))?;
        std::fs::write(&mark, "")?;
        Ok(())
    }
}

/// Runs `c`, saying only `what`; its output is shown when it fails.
fn quiet(c: &mut Command, what: &str) -> Result<()> {
    eprintln!("vmtest: {what}");
    let out = cmd::capture(c)?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The Debian package that ships a shared library, by the naming rule of Debian policy §8.1
/// (`libfoo.so.1` → `libfoo1`; a name ending in a digit takes a hyphen: `libnl-3.so.200` →
/// `libnl-3-200`), with the exceptions met in practice.
pub fn package_for_soname(soname: &str) -> Option<String> {
    match soname {
        "libz.so.1" => return Some("zlib1g".into()),
        "libc.so.6" | "libm.so.6" | "libpthread.so.0" | "libdl.so.2" | "librt.so.1" | "libresolv.so.2" => {
            return Some("libc6".into());
        }
        "libgcc_s.so.1" => return Some("libgcc-s1".into()),
        "libstdc++.so.6" => return Some("libstdc++6".into()),
        // perf's (linux-perf, bookworm) and its libraries'.
        "libopencsd_c_api.so.1" => return Some("libopencsd1".into()),
        "libbabeltrace-ctf.so.1" => return Some("libbabeltrace1".into()),
        "libperl.so.5.36" => return Some("libperl5.36".into()),
        "libpython3.11.so.1.0" => return Some("libpython3.11".into()),
        "libbz2.so.1.0" => return Some("libbz2-1.0".into()),
        "libglib-2.0.so.0" | "libgmodule-2.0.so.0" => return Some("libglib2.0-0".into()),
        _ if soname.starts_with("libunwind-") => return Some("libunwind8".into()),
        _ if soname.starts_with("ld-linux") => return Some("libc6".into()),
        _ => {}
    }
    let (base, ver) = soname.split_once(".so.")?;
    let ver = ver.split('.').next()?;
    let base = base.to_lowercase().replace('_', "-");
    Some(if base.ends_with(|c: char| c.is_ascii_digit()) { format!("{base}-{ver}") } else { format!("{base}{ver}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sonames_map_to_debian_package_names() {
        for (so, pkg) in [
            ("libfdt.so.1", "libfdt1"),
            ("libslirp.so.0", "libslirp0"),
            ("libnl-3.so.200", "libnl-3-200"),
            ("libnl-route-3.so.200", "libnl-route-3-200"),
            ("libcapstone.so.4", "libcapstone4"),
            ("libelf.so.1", "libelf1"),
            ("libz.so.1", "zlib1g"),
            ("libc.so.6", "libc6"),
            ("libzstd.so.1", "libzstd1"),
            ("ld-linux-aarch64.so.1", "libc6"),
            ("libunwind-aarch64.so.8", "libunwind8"),
            ("libpcre2-8.so.0", "libpcre2-8-0"),
        ] {
            assert_eq!(package_for_soname(so).as_deref(), Some(pkg), "{so}");
        }
        assert_eq!(package_for_soname("not-a-library"), None);
    }

    #[test]
    fn package_keys_spell_the_epoch_as_apt_does() {
        let p = Pkg {
            name: "busybox-static".into(),
            arch: "arm64".into(),
            version: "1:1.35.0-4".into(),
            depends: "".into(),
        };
        assert_eq!(p.key(), "busybox-static_1%3a1.35.0-4_arm64");
    }
}
