//! `cargo xtask man` and `cargo xtask package` (heavy: a release build; not
//! part of `cargo xtask test`).
//!
//! - `man [DIR]`: builds the observer and runs its hidden `observer assets DIR`
//!   (default `target/assets`): man pages from the CLI definitions
//!   (clap_mangen: `observer.1`, a page per subcommand) and bash, zsh and fish
//!   completions (clap_complete).
//! - `package`: the Debian package `moe-observer`, laid out here and built by
//!   `dpkg-deb --build --root-owner-group` (Debian's own tool; cargo-deb is not
//!   needed). Its files:
//!   - `/usr/bin/observer` (the test programs live in the unpublished
//!     `fixtures` package, so neither this nor `cargo install` ships them);
//!   - `/lib/systemd/system/moe-observer.service` (`packaging/`), shipped
//!     disabled; `/etc/moe-observer/serve.toml` (a conffile);
//!   - `/usr/share/man/man1/*.1.gz`, the completions in the directories bash,
//!     zsh and fish look in, `/usr/share/doc/moe-observer/{copyright,README.md}`;
//!   - `postinst` (`packaging/debian/`): creates the `moe-observer` user.
//!
//!   `Depends` are the packages owning the shared libraries the binary links
//!   (`ldd`, `dpkg -S`), plus `adduser`.
//!
//!   Then the package is checked, as installed: `dpkg-deb -x` into a
//!   temporary root, every file above present with its mode, the unit's
//!   `ExecStart` names the installed binary, every subcommand of
//!   `observer --help` has its man page, and the installed binary runs
//!   `--version`. Prints the `.deb`'s path.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail, ensure};

use crate::{cache, cmd};

/// The package's name (and its user's).
const PACKAGE: &str = "moe-observer";

/// The release observer binary, built now.
fn build_observer() -> Result<PathBuf> {
    cmd::run(Command::new("cargo").current_dir(cache::workspace_root()).args([
        "build",
        "--release",
        "-p",
        "observer",
        "--bin",
        "observer",
    ]))?;
    Ok(cache::target_dir().join("release/observer"))
}

/// `cargo xtask man [DIR]`.
pub fn man(args: &[String]) -> Result<()> {
    let dir = match args {
        [] => cache::target_dir().join("assets"),
        [d] => PathBuf::from(d),
        _ => bail!("`cargo xtask man` takes at most one argument, the output directory (got {args:?})"),
    };
    let observer = build_observer()?;
    assets(&observer, &dir)?;
    println!("{}", dir.display());
    Ok(())
}

/// Man pages and completions of `observer` into `dir` (`man/`, `completions/`).
fn assets(observer: &Path, dir: &Path) -> Result<()> {
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("emptying {}", dir.display()))?;
    }
    cmd::output(Command::new(observer).arg("assets").arg(dir))?;
    Ok(())
}

/// `cargo xtask package`.
pub fn main(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("`cargo xtask package` takes no arguments (got {args:?})");
    }
    for tool in ["dpkg-deb", "dpkg", "ldd", "gzip", "strip"] {
        ensure!(cmd::on_path(tool), "{tool} is not installed (Debian's dpkg, libc-bin, gzip, binutils)");
    }
    let root = cache::workspace_root();
    let observer = build_observer()?;
    let version = cmd::output(Command::new(&observer).arg("--version"))?;
    let version = version.split_whitespace().nth(1).context("`observer --version` printed no version")?.to_string();
    let arch = cmd::output(Command::new("dpkg").arg("--print-architecture"))?.trim().to_string();
    let out = cache::target_dir().join("package");
    let stage = out.join(format!("{PACKAGE}_{version}_{arch}"));
    if stage.exists() {
        fs::remove_dir_all(&stage).with_context(|| format!("emptying {}", stage.display()))?;
    }
    let assets_dir = out.join("assets");
    assets(&observer, &assets_dir)?;

    let put = |from: &Path, to: &str, mode: u32| -> Result<()> {
        let dest = stage.join(to);
        fs::create_dir_all(dest.parent().unwrap())?;
        fs::copy(from, &dest).with_context(|| format!("copying {} to {}", from.display(), dest.display()))?;
        set_mode(&dest, mode)
    };
    put(&observer, "usr/bin/observer", 0o755)?;
    // The release profile keeps debug info (for profiling); a package ships without it.
    cmd::run(Command::new("strip").arg("--strip-debug").arg(stage.join("usr/bin/observer")))?;
    put(&root.join("packaging/moe-observer.service"), "lib/systemd/system/moe-observer.service", 0o644)?;
    put(&root.join("packaging/serve.toml"), "etc/moe-observer/serve.toml", 0o644)?;
    put(&root.join("LICENSE"), "usr/share/doc/moe-observer/copyright", 0o644)?;
    put(&root.join("README.md"), "usr/share/doc/moe-observer/README.md", 0o644)?;
    let comp = assets_dir.join("completions");
    put(&comp.join("observer.bash"), "usr/share/bash-completion/completions/observer", 0o644)?;
    put(&comp.join("_observer"), "usr/share/zsh/vendor-completions/_observer", 0o644)?;
    put(&comp.join("observer.fish"), "usr/share/fish/vendor_completions.d/observer.fish", 0o644)?;
    let man_dir = stage.join("usr/share/man/man1");
    fs::create_dir_all(&man_dir)?;
    for page in sorted_dir(&assets_dir.join("man"))? {
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        let gz = cmd::capture(Command::new("gzip").args(["-9n", "-c"]).arg(&page))?;
        ensure!(gz.status.success(), "gzip {}: {}", page.display(), String::from_utf8_lossy(&gz.stderr));
        let dest = man_dir.join(format!("{name}.gz"));
        fs::write(&dest, gz.stdout)?;
        set_mode(&dest, 0o644)?;
    }
    put(&root.join("packaging/debian/postinst"), "DEBIAN/postinst", 0o755)?;
    fs::write(stage.join("DEBIAN/conffiles"), "/etc/moe-observer/serve.toml\n")?;
    let control = control(&observer, &version, &arch)?;
    fs::write(stage.join("DEBIAN/control"), &control)?;
    let deb = out.join(format!("{PACKAGE}_{version}_{arch}.deb"));
    cmd::run(Command::new("dpkg-deb").args(["--build", "--root-owner-group"]).arg(&stage).arg(&deb))?;
    check(&deb, &version)?;
    println!("{}", deb.display());
    Ok(())
}

fn set_mode(p: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).with_context(|| format!("chmod {}", p.display()))
}

fn sorted_dir(d: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = fs::read_dir(d)
        .with_context(|| format!("reading {}", d.display()))?
        .map(|e| Ok(e?.path()))
        .collect::<Result<_>>()?;
    v.sort();
    Ok(v)
}

/// `DEBIAN/control`: the manifest's description; Depends from the libraries the binary links.
fn control(observer: &Path, version: &str, arch: &str) -> Result<String> {
    let mut depends: Vec<String> = Vec::new();
    for lib in ldd_names(observer)? {
        // dpkg knows a file by the path its package lists (merged /usr or not).
        let owner = cmd::output(Command::new("dpkg").arg("-S").arg(&lib))
            .or_else(|_| cmd::output(Command::new("dpkg").arg("-S").arg(fs::canonicalize(&lib)?)))
            .with_context(|| format!("which package owns {}", lib.display()))?;
        // "libc6:amd64: /lib/x86_64-linux-gnu/libc.so.6"
        let pkg = owner.lines().next().and_then(|l| l.split(':').next()).unwrap_or_default().to_string();
        if !pkg.is_empty() && !depends.contains(&pkg) {
            depends.push(pkg);
        }
    }
    depends.sort();
    depends.push("adduser".into());
    Ok(format!(
        "Package: {PACKAGE}\nVersion: {version}\nArchitecture: {arch}\nMaintainer: moe-observer developers <moe-observer@localhost>\n\
         Depends: {}\nSection: admin\nPriority: optional\n\
         Description: {}\n {}\n",
        depends.join(", "),
        "eBPF observer: where the time of each token of an LLM engine goes",
        "observer serve is a Prometheus exporter (node daemon) that attributes each token's time to\n \
         compute, faults, swap-in, I/O, reclaim and scheduling, with eBPF."
    ))
}

/// The package as installed (`dpkg-deb -x` into a temporary root): files,
/// modes, the unit, a man page per subcommand, `observer --version`.
fn check(deb: &Path, version: &str) -> Result<()> {
    let root = tempfile_dir()?;
    cmd::run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root))?;
    let info = cmd::output(Command::new("dpkg-deb").arg("--info").arg(deb))?;
    ensure!(info.contains(&format!("Version: {version}")) && info.contains("adduser"), "control:\n{info}");
    let files = [
        ("usr/bin/observer", 0o755),
        ("lib/systemd/system/moe-observer.service", 0o644),
        ("etc/moe-observer/serve.toml", 0o644),
        ("usr/share/doc/moe-observer/copyright", 0o644),
        ("usr/share/man/man1/observer.1.gz", 0o644),
        ("usr/share/man/man1/observer-serve.1.gz", 0o644),
        ("usr/share/bash-completion/completions/observer", 0o644),
        ("usr/share/zsh/vendor-completions/_observer", 0o644),
        ("usr/share/fish/vendor_completions.d/observer.fish", 0o644),
    ];
    for (f, mode) in files {
        use std::os::unix::fs::PermissionsExt;
        let m = fs::metadata(root.join(f)).with_context(|| format!("the package lacks /{f}"))?;
        ensure!(m.permissions().mode() & 0o777 == mode, "/{f}: mode {:o}, not {mode:o}", m.permissions().mode());
    }
    let unit = fs::read_to_string(root.join("lib/systemd/system/moe-observer.service"))?;
    ensure!(
        unit.contains("ExecStart=/usr/bin/observer serve --config /etc/moe-observer/serve.toml"),
        "the unit's ExecStart"
    );
    let bin = root.join("usr/bin/observer");
    let v = cmd::output(Command::new(&bin).arg("--version"))?;
    ensure!(v.trim() == format!("observer {version}"), "the installed binary says {v:?}");
    let help = cmd::output(Command::new(&bin).arg("--help"))?;
    for sub in testkit::help::subcommands(&help) {
        let page = root.join(format!("usr/share/man/man1/observer-{sub}.1.gz"));
        ensure!(page.exists(), "no man page for `observer {sub}` in the package");
    }
    let listing = cmd::output(Command::new("dpkg-deb").arg("-c").arg(deb))?;
    eprintln!(
        "{} files in {}; installed into {}: observer --version = {}",
        listing.lines().count(),
        deb.display(),
        root.display(),
        v.trim()
    );
    fs::remove_dir_all(&root)?;
    Ok(())
}

/// `cargo xtask image`: the container image `moe-observer:VERSION` from
/// `packaging/Containerfile`, built by `buildah bud` (daemonless; Debian's
/// package `buildah`) and saved as an OCI archive beside the `.deb`. Then
/// checked: the image's filesystem, mounted by buildah, holds the binary and
/// every library it needs, and the binary runs `--version` there (chroot into
/// the mount: no container runtime is needed for that).
pub fn image(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("`cargo xtask image` takes no arguments (got {args:?})");
    }
    ensure!(
        cmd::on_path("buildah"),
        "buildah is not installed: `apt-get install buildah` (Debian), then run `cargo xtask image` again"
    );
    let root = cache::workspace_root();
    let observer = build_observer()?;
    let version = cmd::output(Command::new(&observer).arg("--version"))?;
    let version = version.split_whitespace().nth(1).context("`observer --version` printed no version")?.to_string();
    let out = cache::target_dir().join("package");
    let ctx = out.join("image-context");
    if ctx.exists() {
        fs::remove_dir_all(&ctx)?;
    }
    let rootfs = ctx.join("rootfs");
    let put = |from: &Path, to: &Path, mode: u32| -> Result<()> {
        let dest = rootfs.join(to.strip_prefix("/").unwrap_or(to));
        fs::create_dir_all(dest.parent().unwrap())?;
        fs::copy(from, &dest).with_context(|| format!("copying {} to {}", from.display(), dest.display()))?;
        set_mode(&dest, mode)
    };
    put(&observer, Path::new("/usr/bin/observer"), 0o755)?;
    cmd::run(Command::new("strip").arg("--strip-debug").arg(rootfs.join("usr/bin/observer")))?;
    put(&root.join("packaging/serve.toml"), Path::new("/etc/moe-observer/serve.toml"), 0o644)?;
    // The libraries under the names the loader asks for, and the loader itself.
    for lib in ldd_names(&observer)? {
        put(&fs::canonicalize(&lib)?, &lib, 0o755)?;
    }
    fs::copy(root.join("packaging/Containerfile"), ctx.join("Containerfile"))?;
    let tag = format!("localhost/{PACKAGE}:{version}");
    cmd::run(
        Command::new("buildah")
            .args(["bud", "--quiet", "-f"])
            .arg(ctx.join("Containerfile"))
            .args(["-t", &tag])
            .arg(&ctx),
    )?;
    let archive = out.join(format!("{PACKAGE}_{version}.oci.tar"));
    let _ = fs::remove_file(&archive);
    cmd::run(Command::new("buildah").args(["push", &tag]).arg(format!("oci-archive:{}", archive.display())))?;
    // Check the image as built: its own filesystem, its config.
    let ctr = cmd::output(Command::new("buildah").args(["from", &tag]))?.trim().to_string();
    let checked = (|| -> Result<String> {
        let mnt = PathBuf::from(cmd::output(Command::new("buildah").args(["mount", &ctr]))?.trim());
        let v = cmd::output(Command::new("chroot").arg(&mnt).args(["/usr/bin/observer", "--version"]))?;
        ensure!(v.trim() == format!("observer {version}"), "the image's binary says {v:?}");
        let cfg = cmd::output(Command::new("buildah").args([
            "inspect",
            "--format",
            "{{.OCIv1.Config.Entrypoint}} {{.OCIv1.Config.Cmd}}",
            &tag,
        ]))?;
        ensure!(cfg.contains("/usr/bin/observer") && cfg.contains("serve"), "the image's entrypoint: {cfg}");
        Ok(v.trim().to_string())
    })();
    let _ = cmd::capture(Command::new("buildah").args(["umount", &ctr]));
    let _ = cmd::capture(Command::new("buildah").args(["rm", &ctr]));
    let v = checked?;
    eprintln!("image {tag}: `{v}` inside it; saved as {}", archive.display());
    println!("{}", archive.display());
    Ok(())
}

/// The libraries `ldd` lists for a binary, by the absolute name the loader
/// uses (the loader included).
fn ldd_names(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = cmd::output(Command::new("ldd").arg(bin))?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let p = l.split("=>").nth(1).unwrap_or(l).split_whitespace().next()?;
            p.starts_with('/').then(|| PathBuf::from(p))
        })
        .collect())
}

fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("moe-observer-deb-{}", std::process::id()));
    if d.exists() {
        fs::remove_dir_all(&d)?;
    }
    fs::create_dir_all(&d)?;
    Ok(d)
}
