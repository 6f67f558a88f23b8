//! `observer serve --config FILE`: the flags of `serve` from a TOML file (the
//! file's spec and its reading: `observer::config`).

use std::{ffi::OsString, path::Path};

use anyhow::{Context, Result};
use clap::{Args, Command};

use super::serve::ServeArgs;

/// `argv` with the flags of `serve --config FILE` inserted after `serve`
/// (unchanged for any other subcommand or without `--config`).
pub fn expand(argv: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(at) = argv.iter().position(|a| a == "serve") else { return Ok(argv) };
    // Only flags of `serve`, before any `--` (the command's own arguments).
    let own_end = argv.iter().skip(at).position(|a| a == "--").map_or(argv.len(), |i| at + i);
    let own: Vec<String> = argv[at + 1..own_end].iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let file = own.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--config") {
        Some("") => own.get(i + 1).cloned(),
        Some(v) => v.strip_prefix('=').map(str::to_string),
        None => None,
    });
    let Some(file) = file else { return Ok(argv) };
    let text = std::fs::read_to_string(&file).with_context(|| format!("--config {file}: cannot read it"))?;
    let extra =
        observer::config::flags(&ServeArgs::augment_args(Command::new("serve")), Path::new(&file), &text, &own)?;
    let mut out = argv;
    out.splice(at + 1..at + 1, extra.into_iter().map(OsString::from));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str]) -> Result<ServeArgs, clap::Error> {
        use clap::FromArgMatches;
        let m = ServeArgs::augment_args(Command::new("serve")).try_get_matches_from(argv)?;
        ServeArgs::from_arg_matches(&m)
    }

    #[test]
    fn the_file_gives_serve_its_flags_and_the_command_line_wins() {
        let dir = std::env::temp_dir().join(format!("observer-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("serve.toml");
        std::fs::write(&f, "\"web.listen-address\" = \"0.0.0.0:9100\"\nname = \"engine\"\nevery = 5\n").unwrap();
        let argv = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        let f_s = f.to_str().unwrap();
        let out = expand(argv(&["observer", "-v", "serve", "--config", f_s])).unwrap();
        let strs: Vec<&str> = out.iter().map(|a| a.to_str().unwrap()).collect();
        let args = parse(&strs[2..]).unwrap();
        assert_eq!(args.run.metrics_addr.as_deref(), Some("0.0.0.0:9100"));
        assert_eq!(args.name.as_deref(), Some("engine"));
        assert_eq!(args.run.every, 5);
        // The command line wins, under either name of the flag.
        let out = expand(argv(&["observer", "serve", "--metrics-addr=:1234", "--config", f_s])).unwrap();
        let strs: Vec<&str> = out.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(parse(&strs[1..]).unwrap().run.metrics_addr.as_deref(), Some(":1234"));
        // Other subcommands are left alone.
        assert_eq!(expand(argv(&["observer", "run", "--", "serve"])).unwrap().len(), 4);

        for (bad, says) in [
            ("nmae = \"engine\"\n", "unknown key \"nmae\""),
            ("every = [1, true]\n", "where a string or a number goes"),
            ("name = \n", "not a valid TOML file"),
        ] {
            std::fs::write(&f, bad).unwrap();
            let e = format!("{:#}", expand(argv(&["observer", "serve", "--config", f_s])).unwrap_err());
            assert!(e.contains(says) && e.contains(f_s), "{bad:?}: {e}");
        }
        let e = format!("{:#}", expand(argv(&["observer", "serve", "--config", "/nonexistent.toml"])).unwrap_err());
        assert!(e.contains("/nonexistent.toml") && e.contains("No such file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
