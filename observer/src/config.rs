//! `observer serve --config FILE`: the flags of `serve` from a TOML file.
//!
//! ## Spec
//! - The file is a flat TOML table. Each key is the long name of a `serve`
//!   flag without its dashes (`metrics-addr = "0.0.0.0:9977"`, `name =
//!   "engine"`, `every = 0`); the names `serve --help` shows, aliases included
//!   (`"web.listen-address"`, quoted since TOML splits keys at dots).
//! - Values: a string or a number is the flag's value; `true` gives a flag
//!   that takes no value, `false` leaves it out; an array repeats the flag once
//!   per element.
//! - The command line wins: a flag given there is not taken from the file.
//! - An unknown key, a nested table or a value of the wrong kind is an error
//!   naming the file and the key.

use std::path::Path;

use anyhow::{Context, Result, bail};
use clap::Command;

/// The flags the file `path` (contents `text`) gives, less those in `given`; `cmd` is the
/// subcommand whose flags the keys name (`serve`'s).
pub fn flags(cmd: &Command, path: &Path, text: &str, given: &[String]) -> Result<Vec<String>> {
    let p = path.display();
    let table: toml::Table = text.parse().with_context(|| format!("--config {p}: not a valid TOML file"))?;
    let mut out = Vec::new();
    for (key, value) in &table {
        let Some(arg) = cmd.get_arguments().find(|a| {
            a.get_long() == Some(key.as_str()) || a.get_all_aliases().is_some_and(|al| al.contains(&key.as_str()))
        }) else {
            let keys: Vec<&str> = cmd.get_arguments().filter_map(|a| a.get_long()).filter(|l| *l != "config").collect();
            bail!(
                "--config {p}: unknown key {key:?} (the keys are the flags of `observer serve`: {})",
                keys.join(", ")
            );
        };
        let mut names: Vec<&str> = arg.get_all_aliases().unwrap_or_default();
        names.extend(arg.get_long());
        if given.iter().any(|g| names.iter().any(|n| g == &format!("--{n}") || g.starts_with(&format!("--{n}=")))) {
            continue;
        }
        let flag = format!("--{}", arg.get_long().unwrap_or(key));
        let takes_value = arg.get_action().takes_values();
        let items: Vec<&toml::Value> = match value {
            toml::Value::Array(a) => a.iter().collect(),
            v => vec![v],
        };
        for v in items {
            match (v, takes_value) {
                (toml::Value::Boolean(true), false) => out.push(flag.clone()),
                (toml::Value::Boolean(false), false) => {}
                (toml::Value::String(s), true) => out.extend([flag.clone(), s.clone()]),
                (toml::Value::Integer(i), true) => out.extend([flag.clone(), i.to_string()]),
                (toml::Value::Float(f), true) => out.extend([flag.clone(), f.to_string()]),
                (_, false) => bail!("--config {p}: {key} is a switch: give true or false"),
                (v, true) => bail!("--config {p}: {key}: a {} where a string or a number goes", v.type_str()),
            }
        }
    }
    Ok(out)
}
