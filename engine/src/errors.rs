//! How the command lines (`engine`, `observer`) print an error: one line,
//! the error and its causes joined by `: `, a cause left out when the text
//! so far already ends with it (an error whose message includes its source,
//! as `GgufError::Io` does, would otherwise print the OS error twice). No
//! backtrace, whatever `RUST_BACKTRACE` says: a user error is not a bug.

/// The error chain of `e` as one line (see the module doc).
pub fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let os = std::io::Error::from_raw_os_error(2);
        let e = anyhow::Error::new(std::io::Error::other(format!("/m.gguf: {os}"))).context("reading /m.gguf");
        assert_eq!(one_line(&e), "reading /m.gguf: /m.gguf: No such file or directory (os error 2)");
        let e = anyhow::Error::new(std::io::Error::from_raw_os_error(13)).context("cannot open x");
        assert_eq!(one_line(&e), "cannot open x: Permission denied (os error 13)");
    }
}
