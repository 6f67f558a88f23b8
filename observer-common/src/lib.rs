//! Types shared by `observer-ebpf` (kernel side) and `observer` (user side).
//!
//! Every struct that crosses the kernel↔user boundary is defined here, once:
//! `#[repr(C)]`, `Copy`, only fixed-width integers and arrays of them, explicit
//! padding, and a const size assertion so that a layout change is a compile
//! error on both sides rather than a silent misread.
//!
//! With the `user` feature the types also implement `aya::Pod`, so user space
//! can read them out of maps, and the model stream (`model`) is available.
//!
//! The names of everything the observer measures are defined once, in
//! [`vocab`]; the kernel side's array indices are read from it.
#![no_std]

#[cfg(feature = "user")]
extern crate std;

pub mod attrib;
#[cfg(feature = "serde")]
pub mod bench_cliff;
pub mod budget;
pub mod evict;
pub mod faults;
pub mod filemap;
pub mod hist;
#[cfg(feature = "user")]
pub mod model;
#[cfg(feature = "user")]
pub mod totals;
pub mod vocab;
pub mod xread;

pub use faults::{Config, FaultTimes, GlobalCounter, OverflowFaults};
pub use hist::HIST_BUCKETS;
