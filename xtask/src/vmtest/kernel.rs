//! The kernels of the matrix: Debian's cloud kernel images, unpacked from their `.deb` (image,
//! config, modules), and the modules a guest needs, in the order `insmod` must load them.
//!
//! A module's dependencies are the `depends=` entry of its `.modinfo` section (what `depmod`
//! reads); a module the kernel has built in is listed in `modules.builtin` and needs no file.
//! Compressed modules (`.ko.xz`, `.ko.zst`) are decompressed on the host, so that busybox's
//! `insmod` never has to.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use object::{Object, ObjectSection};

use super::{Arch, debian};

/// A kernel of the matrix: which Debian package provides it.
#[derive(Debug, Clone, Copy)]
pub struct KernelSpec {
    /// The name `--kernel` takes.
    pub name: &'static str,
    pub arch: Arch,
    /// A meta-package that pins the current image package (so the version follows Debian's
    /// security updates when the lists are refreshed).
    pub meta: &'static str,
    pub about: &'static str,
    /// In the matrix `cargo xtask vmtest` runs without `--kernel` or `--all`.
    pub default: bool,
}

pub const KERNELS: &[KernelSpec] = &[
    KernelSpec {
        name: "debian-6.1",
        arch: Arch::X86_64,
        meta: "linux-image-cloud-amd64",
        about: "Debian 12's LTS kernel (bookworm, security updates)",
        default: true,
    },
    KernelSpec {
        name: "debian-6.12",
        arch: Arch::X86_64,
        meta: "linux-image-6.12-cloud-amd64",
        about: "the newer kernel Debian 12 offers (6.12)",
        default: false,
    },
    KernelSpec {
        name: "debian-6.1-arm64",
        arch: Arch::Aarch64,
        meta: "linux-image-cloud-arm64:arm64",
        about: "Debian 12's LTS kernel for arm64, under qemu-system-aarch64 -M virt",
        default: true,
    },
];

/// A module for the guest: its name and its (decompressed) file.
pub type Module = (String, Vec<u8>);

/// An unpacked kernel package.
pub struct Kernel {
    pub pkg: debian::Pkg,
    /// `uname -r` of the kernel, from its modules directory.
    pub release: String,
    pub image: PathBuf,
    pub config: PathBuf,
    modules: PathBuf,
}

impl Kernel {
    pub fn get(apt: &debian::Apt, spec: KernelSpec) -> Result<Kernel> {
        let pkg = apt.resolve_meta(spec.meta, None)?;
        let dir = apt.unpacked(&pkg)?;
        let modules_root = [dir.join("lib/modules"), dir.join("usr/lib/modules")]
            .into_iter()
            .find(|d| d.is_dir())
            .with_context(|| format!("{}: no lib/modules in {}", pkg.name, dir.display()))?;
        let release = std::fs::read_dir(&modules_root)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .next()
            .with_context(|| format!("{} is empty", modules_root.display()))?;
        let boot = dir.join("boot");
        let image = boot.join(format!("vmlinuz-{release}"));
        let config = boot.join(format!("config-{release}"));
        for f in [&image, &config] {
            if !f.exists() {
                bail!("{} {}: {} missing", pkg.name, pkg.version, f.display());
            }
        }
        Ok(Kernel { pkg, modules: modules_root.join(&release), release, image, config })
    }

    /// The module files that load `wanted` (names with `_` or `-`), dependencies first, as
    /// (name, decompressed contents). A wanted module that is built in needs nothing; one this
    /// kernel has neither built in nor as a file is returned in the second list.
    pub fn modules(&self, wanted: &[&str]) -> Result<(Vec<Module>, Vec<String>)> {
        let norm = |s: &str| s.replace('-', "_");
        let mut files = BTreeMap::new();
        index_modules(&self.modules.join("kernel"), &mut files)?;
        let builtin: BTreeSet<String> = std::fs::read_to_string(self.modules.join("modules.builtin"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.rsplit('/').next())
            .map(|f| norm(f.trim_end_matches(".ko")))
            .collect();
        let (mut order, mut seen, mut absent) = (Vec::new(), BTreeSet::new(), Vec::new());
        fn visit(
            name: &str,
            files: &BTreeMap<String, PathBuf>,
            builtin: &BTreeSet<String>,
            seen: &mut BTreeSet<String>,
            order: &mut Vec<(String, Vec<u8>)>,
            absent: &mut Vec<String>,
        ) -> Result<()> {
            if !seen.insert(name.to_string()) || builtin.contains(name) {
                return Ok(());
            }
            let Some(path) = files.get(name) else {
                absent.push(name.to_string());
                return Ok(());
            };
            let data = read_module(path)?;
            for dep in modinfo(&data, "depends").with_context(|| format!("reading {}", path.display()))? {
                for d in dep.split(',').filter(|d| !d.is_empty()) {
                    visit(&d.replace('-', "_"), files, builtin, seen, order, absent)?;
                }
            }
            order.push((name.to_string(), data));
            Ok(())
        }
        for w in wanted {
            visit(&norm(w), &files, &builtin, &mut seen, &mut order, &mut absent)?;
        }
        Ok((order, absent))
    }
}

/// Module name (with `_`) → file, for every `.ko`, `.ko.xz` and `.ko.zst` under `dir`.
fn index_modules(dir: &Path, out: &mut BTreeMap<String, PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.flatten() {
        let p = e.path();
        if e.file_type()?.is_dir() {
            index_modules(&p, out)?;
            continue;
        }
        let f = e.file_name().to_string_lossy().into_owned();
        if let Some(stem) = [".ko", ".ko.xz", ".ko.zst"].iter().find_map(|s| f.strip_suffix(s)) {
            out.insert(stem.replace('-', "_"), p);
        }
    }
    Ok(())
}

fn read_module(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        "xz"
    } else if name.ends_with(".zst") {
        "zstd"
    } else {
        return std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    };
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .output()
        .with_context(|| format!("`{tool}` is needed to decompress {}: install it", path.display()))?;
    if !out.status.success() {
        bail!("{tool} -dc {} failed: {}", path.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

/// The values of `key` in a module's `.modinfo` section (NUL-separated `key=value` strings).
fn modinfo(module: &[u8], key: &str) -> Result<Vec<String>> {
    let f = object::File::parse(module).context("a kernel module is an ELF file")?;
    let Some(s) = f.section_by_name(".modinfo") else { return Ok(Vec::new()) };
    let data = s.data()?;
    Ok(data
        .split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok()?.strip_prefix(key)?.strip_prefix('=').map(str::to_string))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_unique() {
        let names: BTreeSet<&str> = KERNELS.iter().map(|k| k.name).collect();
        assert_eq!(names.len(), KERNELS.len());
    }
}
