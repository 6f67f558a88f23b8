//! The guest's files: an initramfs with the system (busybox, bpftool, fincore, the libraries
//! they and the workspace's binaries load, kernel modules, the BPF probe objects, `/init` and the
//! plan) and, for a guest of the host's architecture, an ext4 disk with the workspace's
//! binaries and test binaries.
//!
//! The disk is mounted at the host's cargo target directory, so every path a test binary has
//! compiled in (`CARGO_BIN_EXE_observer`, `CARGO_TARGET_TMPDIR`, which holds the tests' scratch
//! files) is the same inside the guest, and scratch files live on a block device (file refaults
//! need one; the initramfs is RAM). Programs of the host's architecture take their libraries from
//! the host (`ldd`); programs of another architecture from Debian's packages for it (each
//! `DT_NEEDED` library's package, by Debian's naming rule, and the `PT_INTERP` loader from
//! `libc6`).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};

use super::{
    Arch,
    cpio::{Archive, Entry},
    debian, elf,
    kernel::Kernel,
};
use crate::cmd;

/// Where a program's shared libraries come from.
pub enum Libs<'a> {
    /// This machine's, as `ldd` lists them (the guest has the host's architecture).
    Host,
    /// Debian's packages for the guest's architecture.
    Debian(&'a debian::Apt, Arch),
}

pub struct Builder<'a> {
    pub archive: Archive,
    libs: Libs<'a>,
    added_libs: BTreeSet<String>,
}

impl<'a> Builder<'a> {
    pub fn new(libs: Libs<'a>) -> Builder<'a> {
        Builder { archive: Archive::default(), libs, added_libs: BTreeSet::new() }
    }

    pub fn file(&mut self, at: &str, data: Vec<u8>, mode: u32) {
        self.archive.add(at, Entry::File(data, mode));
    }

    /// The libraries `program` (a file on the host, for the guest's architecture) loads,
    /// into the initramfs.
    pub fn libraries_of(&mut self, program: &Path) -> Result<()> {
        match self.libs {
            Libs::Host => {
                let out = cmd::output(Command::new("ldd").arg(program))?;
                for l in out.lines() {
                    if l.contains("not found") {
                        bail!("{}: {}", program.display(), l.trim());
                    }
                    // `libc.so.6 => /lib/…/libc.so.6 (0x…)` or `/lib64/ld-linux-x86-64.so.2 (0x…)`.
                    let path = l.split("=>").last().unwrap_or("").split_whitespace().next().unwrap_or("");
                    if path.starts_with('/') && self.added_libs.insert(path.to_string()) {
                        let data = std::fs::read(path).with_context(|| format!("reading {path}"))?;
                        self.file(path, data, 0o755);
                    }
                }
                Ok(())
            }
            Libs::Debian(apt, arch) => {
                let data = std::fs::read(program)?;
                self.debian_libraries(apt, arch, &data, &program.display().to_string())
            }
        }
    }

    fn debian_libraries(&mut self, apt: &debian::Apt, arch: Arch, data: &[u8], what: &str) -> Result<()> {
        let (needed, interp) = elf::needs(data).with_context(|| format!("reading {what}"))?;
        let triplet = arch.triplet();
        let mut wanted: Vec<(String, String)> =
            needed.into_iter().map(|so| (format!("/lib/{triplet}/{so}"), so)).collect();
        if let Some(i) = interp {
            let name = Path::new(&i).file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            wanted.push((i, name));
        }
        for (at, so) in wanted {
            if !self.added_libs.insert(at.clone()) {
                continue;
            }
            let pkg = debian::package_for_soname(&so)
                .with_context(|| format!("{what} needs {so}, which names no Debian package"))?;
            let p = apt.candidate(&format!("{pkg}:{}", arch.debian()), None)?;
            let dir = apt.unpacked(&p)?;
            let found = [format!("lib/{triplet}"), format!("usr/lib/{triplet}"), "lib".into(), "usr/lib".into()]
                .iter()
                .map(|d| dir.join(d).join(&so))
                .find(|p| p.exists())
                .with_context(|| format!("{} {} has no {so} (needed by {what})", p.name, p.version))?;
            let lib = std::fs::read(&found).with_context(|| format!("reading {}", found.display()))?;
            self.debian_libraries(apt, arch, &lib, &so)?;
            self.file(&at, lib, 0o755);
        }
        Ok(())
    }

    /// A program of the guest's architecture at `at`, with its libraries.
    pub fn program(&mut self, src: &Path, at: &str) -> Result<()> {
        self.libraries_of(src)?;
        let data = std::fs::read(src).with_context(|| format!("reading {}", src.display()))?;
        self.file(at, data, 0o755);
        Ok(())
    }

    /// Kernel modules, `NN-name.ko` in the order `init` loads them.
    pub fn modules(&mut self, kernel: &Kernel, wanted: &[&str]) -> Result<(Vec<String>, Vec<String>)> {
        let (order, absent) = kernel.modules(wanted)?;
        let mut names = Vec::new();
        for (i, (name, data)) in order.into_iter().enumerate() {
            self.file(&format!("vmtest/modules/{i:02}-{name}.ko"), data, 0o644);
            names.push(name);
        }
        Ok((names, absent))
    }

    pub fn write(&self, path: &Path) -> Result<u64> {
        let bytes = self.archive.to_bytes();
        std::fs::write(path, &bytes).with_context(|| format!("writing {}", path.display()))?;
        Ok(bytes.len() as u64)
    }
}

/// An ext4 image of `size_gib` (sparse) holding `files` (host path, path inside the image).
pub fn disk(path: &Path, staging: &Path, files: &[(PathBuf, PathBuf)], size_gib: u64) -> Result<u64> {
    let _ = std::fs::remove_dir_all(staging);
    std::fs::create_dir_all(staging.join("tmp"))?;
    let mut bytes = 0;
    for (src, rel) in files {
        let dst = staging.join(rel);
        std::fs::create_dir_all(dst.parent().expect("a file in a directory"))?;
        if std::fs::hard_link(src, &dst).is_err() {
            std::fs::copy(src, &dst).with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
        }
        bytes += std::fs::metadata(src)?.len();
    }
    let _ = std::fs::remove_file(path);
    if !cmd::on_path("mke2fs") {
        bail!("mke2fs (e2fsprogs) is needed to make the guest's disk: `apt-get install e2fsprogs`");
    }
    cmd::run(
        Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-L", "vmtest", "-d"])
            .arg(staging)
            .arg(path)
            .arg(format!("{size_gib}G")),
    )?;
    std::fs::remove_dir_all(staging)?;
    Ok(bytes)
}
