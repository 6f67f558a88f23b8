//! The embedded MoE engine.
