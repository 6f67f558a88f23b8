//! Token markers: the engine's side of the token-marker ABI, specified in [`moe_abi::markers`]
//! (the functions, the 152-byte record, the kinds, *not measured*). What this engine measures in
//! each field of the record is in [`crate::telemetry`].

pub use moe_abi::NOT_MEASURED;
pub use moe_abi::markers::*;

// `moe_engine_token_begin` and `moe_engine_token_end`, exported by the `engine` binary.
moe_abi::token_markers!();
