//! Where heavy, reproducible artifacts live: outside the clone, under
//! `${XDG_CACHE_HOME:-$HOME/.cache}/moe-observer/`, keyed by version and shape
//! in their own subdirectories, rebuilt when missing.

use std::path::PathBuf;

use anyhow::{Context, Result};

pub fn dir() -> Result<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?).join(".cache"),
    };
    let d = base.join("moe-observer");
    std::fs::create_dir_all(&d).with_context(|| format!("creating cache dir {}", d.display()))?;
    Ok(d)
}

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."))
}

/// Cargo's target directory (honours CARGO_TARGET_DIR).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => {
            let p = PathBuf::from(d);
            if p.is_absolute() { p } else { workspace_root().join(p) }
        }
        _ => workspace_root().join("target"),
    }
}
