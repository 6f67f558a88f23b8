//! Terminal views of the observer's model stream (`observer_common::model`).
//!
//! The split follows tokio-console: [`state`] holds what the stream said
//! ([`App`], fed one [`Event`](observer_common::model::Event) at a time by a
//! live run or a replayed trace alike), [`view`] draws it with a pure
//! `draw(&App, &mut Frame)`, [`input`] maps keys to [`Effect`]s that the state
//! applies, and [`term`] owns the terminal and runs the loop. [`stats`] has
//! the seeded bootstrap behind the tok/s interval.
//!
//! This crate depends on `observer-common` only; the `observer` binary
//! depends on it (`observer tui`), never the other way round.

pub mod input;
pub mod state;
pub mod stats;
pub mod term;
pub mod view;

pub use state::{App, Control, Effect, Scroll, View};
pub use term::{IterSource, Options, Source, Status};
pub use view::draw;
