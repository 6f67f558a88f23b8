//! Colour in the observer's output. Rule: escape codes are written only to a
//! terminal, and never when `NO_COLOR` is set to a non-empty value
//! (no-color.org); files and pipes get plain text. Warnings that need the
//! eye (lost or dropped events) are red.

use std::io::IsTerminal;

/// Where a text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// Whether colour may be written to `stream` (the rule above).
pub fn colour(stream: Stream) -> bool {
    let wanted = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    wanted
        && match stream {
            Stream::Stdout => std::io::stdout().is_terminal(),
            Stream::Stderr => std::io::stderr().is_terminal(),
        }
}

/// `text` in red when `stream` takes colour, as is otherwise.
pub fn alarm(text: &str, stream: Stream) -> String {
    if colour(stream) { format!("\x1b[31m{text}\x1b[0m") } else { text.to_string() }
}
