//! The result file of `cargo xtask bench cliff --json FILE`, read by `observer plot cliff`
//! (user space only: the `serde` feature, which `user` implies). Defined here, once, for the
//! writer (xtask) and the reader (the observer's `plot::cliff`).
//!
//! ## Format `moe-observer bench-cliff v1`
//! A JSON object `{"format": FORMAT, "model": path, "model_bytes": n, "cells": [cell, …]}`,
//! each cell one run of one system under one memory limit:
//! `{"system": "engine cache", "round": r, "limit_pct": 60.0 | null (unlimited), "tok_s": f,
//! "first_tok_s": f | null, "read_bytes_per_token": f | null, "hit_pct": f | null,
//! "components_ms": {"compute": f, …} | null}`:
//! - `tok_s`: tokens per second over the measured tokens (those after the warm-up);
//! - `first_tok_s`: over the warm-up tokens;
//! - `read_bytes_per_token`: bytes read from storage per measured token (the observer's);
//! - `hit_pct`: the engine's expert cache hit rate (`null`: the system has no such cache);
//! - `components_ms`: the observer's split of a measured token, ms per token, keyed by the
//!   component names of [`crate::vocab`].
//!
//! `null` is *not measured*, never 0. A reader draws several rounds of one (system, limit) as
//! their median.

extern crate alloc;

use alloc::{collections::BTreeMap, string::String, vec::Vec};

use serde::{Deserialize, Serialize};

/// The value of `format`.
pub const FORMAT: &str = "moe-observer bench-cliff v1";

/// A whole result file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CliffBench {
    pub format: String,
    pub model: String,
    pub model_bytes: u64,
    pub cells: Vec<Cell>,
}

/// One run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    pub system: String,
    #[serde(default)]
    pub round: u32,
    /// The memory limit in % of the model file; `None`: unlimited.
    pub limit_pct: Option<f64>,
    pub tok_s: f64,
    pub first_tok_s: Option<f64>,
    pub read_bytes_per_token: Option<f64>,
    pub hit_pct: Option<f64>,
    pub components_ms: Option<BTreeMap<String, f64>>,
}

impl CliffBench {
    /// An empty result of `model` (`model_bytes` long), in this format.
    pub fn new(model: String, model_bytes: u64) -> CliffBench {
        CliffBench { format: FORMAT.into(), model, model_bytes, cells: Vec::new() }
    }
}
