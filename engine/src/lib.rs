//! The embedded MoE engine.

pub mod quant;
