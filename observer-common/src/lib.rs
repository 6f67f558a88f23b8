//! Types shared by `observer-ebpf` (kernel side) and `observer` (user side).
#![no_std]
