//! `cargo xtask demo`: the project's front door. Until the engine and the TUI
//! exist it observes the built-in `workload demo` (file refaults, then fresh
//! anonymous memory) and prints the observer's table.

use std::process::Command;

use anyhow::Result;

use crate::{cache, cmd, setup};

pub fn run(_args: &[String]) -> Result<()> {
    setup::run(setup::Scope::All)?;
    let root = cache::workspace_root();
    cmd::run(Command::new("cargo").current_dir(&root).args(["build", "--release", "-p", "observer", "--bins"]))?;
    let bin = cache::target_dir().join("release");
    let file = cache::dir()?.join("demo-refault.bin");
    cmd::run(
        Command::new(bin.join("observer"))
            .args(["run", "--"])
            .arg(bin.join("workload"))
            .args(["demo", "--size", "128M", "--path"])
            .arg(&file),
    )
}
