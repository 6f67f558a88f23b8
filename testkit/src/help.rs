//! Reading a clap program's `--help`: what the packaging test and `cargo xtask package` check
//! the man pages against.

/// The subcommands a `--help` text lists (its "Commands:" block, `help` left out).
pub fn subcommands(help: &str) -> Vec<String> {
    help.split("Commands:")
        .nth(1)
        .unwrap_or("")
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        // A wrapped description goes on deeper indented.
        .filter(|l| !l[2..].starts_with(' '))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|s| *s != "help")
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subcommands_are_read_from_the_help() {
        let help = "Usage: observer <COMMAND>\n\nCommands:\n  run     Observe\n  serve   A standing\n          wrapped text\n  help    Print this\n\nOptions:\n  -v\n";
        assert_eq!(subcommands(help), ["run", "serve"]);
    }
}
