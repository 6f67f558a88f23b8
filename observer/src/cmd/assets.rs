//! `observer assets DIR` (hidden; run by `cargo xtask man`): what a package
//! installs beside the binary, generated from the CLI's own definitions so it
//! cannot drift from them:
//! - `DIR/man/observer.1` and one page per visible subcommand, nested ones
//!   included (`observer-serve.1`, `observer-plot-cliff.1`), by clap_mangen;
//! - `DIR/completions/`: `observer.bash`, `_observer` (zsh), `observer.fish`,
//!   by clap_complete.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap_complete::Shell;

#[derive(Debug, clap::Args)]
pub struct AssetsArgs {
    /// Where to write `man/` and `completions/` (created if missing).
    pub dir: PathBuf,
}

pub fn write(cli: clap::Command, args: &AssetsArgs) -> Result<i32> {
    let man = args.dir.join("man");
    let completions = args.dir.join("completions");
    for d in [&man, &completions] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    clap_mangen::generate_to(cli.clone(), &man).with_context(|| format!("writing man pages into {}", man.display()))?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        clap_complete::generate_to(shell, &mut cli.clone(), "observer", &completions)
            .with_context(|| format!("writing {shell} completions into {}", completions.display()))?;
    }
    println!("{}\n{}", man.display(), completions.display());
    Ok(0)
}
