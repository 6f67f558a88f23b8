//! `cargo xtask package`: the Debian package of the observer (heavy: a
//! release build), made by cargo-deb from `[package.metadata.deb]` in
//! `observer/Cargo.toml`: `/usr/bin/observer`, the systemd unit and the
//! default `serve.toml` from `packaging/`, the LICENSE, a postinst that
//! creates the `moe-observer` user. Prints the `.deb`'s path.

use std::process::Command;

use anyhow::{Result, bail};

use crate::cmd;

pub fn main(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("`cargo xtask package` takes no arguments (got {args:?})");
    }
    let has_deb = Command::new("cargo").args(["deb", "--version"]).output().is_ok_and(|o| o.status.success());
    if !has_deb {
        bail!("cargo-deb is not installed: `cargo install cargo-deb`, then run `cargo xtask package` again");
    }
    cmd::run(Command::new("cargo").args(["deb", "-p", "observer"]))
}
