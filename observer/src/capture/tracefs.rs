//! Tracepoint field offsets from tracefs `format` files.
//!
//! Rust eBPF programs get no CO-RE relocations, so the offsets of the fields
//! they read are parsed here at start-up and handed to them in a map. A format
//! file looks like
//! `\tfield:pid_t prev_pid;\toffset:24;\tsize:4;\tsigned:1;`.

use std::{collections::HashMap, path::Path};

use anyhow::{Context, Result, bail};

use crate::capture::preflight::TRACEFS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub offset: u32,
    pub size: u32,
}

/// Parse a format file's text into field name → (offset, size).
pub fn parse_format(text: &str) -> HashMap<String, Field> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("field:") else { continue };
        let mut parts = rest.split(';').map(str::trim);
        let Some(decl) = parts.next() else { continue };
        // The name is the last identifier of the declaration, minus any [N].
        let name = decl
            .rsplit(|c: char| c.is_whitespace() || c == '*')
            .next()
            .unwrap_or("")
            .split('[')
            .next()
            .unwrap_or("")
            .to_string();
        let mut offset = None;
        let mut size = None;
        for p in parts {
            if let Some(v) = p.strip_prefix("offset:") {
                offset = v.parse().ok();
            } else if let Some(v) = p.strip_prefix("size:") {
                size = v.parse().ok();
            }
        }
        if let (Some(offset), Some(size)) = (offset, size)
            && !name.is_empty()
        {
            out.insert(name, Field { offset, size });
        }
    }
    out
}

/// The fields of one tracepoint.
#[derive(Debug)]
pub struct Format {
    pub category: String,
    pub name: String,
    fields: HashMap<String, Field>,
}

impl Format {
    pub fn load(category: &str, name: &str) -> Result<Self> {
        let path = Path::new(TRACEFS).join("events").join(category).join(name).join("format");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("this kernel has no tracepoint {category}:{name} ({} unreadable)", path.display())
        })?;
        Ok(Format { category: category.into(), name: name.into(), fields: parse_format(&text) })
    }

    pub fn field(&self, field: &str) -> Result<Field> {
        match self.fields.get(field) {
            Some(f) => Ok(*f),
            None => bail!("tracepoint {}:{} has no field `{field}` on this kernel", self.category, self.name),
        }
    }

    pub fn offset(&self, field: &str) -> Result<u32> {
        Ok(self.field(field)?.offset)
    }

    /// The offsets of all of `fields`, in order, or an error naming the first one missing.
    pub fn offsets(&self, fields: &[&str]) -> Result<Vec<u32>> {
        fields.iter().map(|f| self.offset(f)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tracepoint_or_field_is_named() {
        let e = Format::load("no_such_category", "no_such_event").unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("no tracepoint no_such_category:no_such_event"), "{msg}");
        let f = Format { category: "sched".into(), name: "sched_switch".into(), fields: parse_format("") };
        let msg = format!("{:#}", f.field("prev_state").unwrap_err());
        assert!(msg.contains("sched:sched_switch has no field `prev_state`"), "{msg}");
    }

    #[test]
    fn offsets_are_all_or_an_error_naming_the_missing_field() {
        let text = "format:\n\tfield:pid_t pid;\toffset:8;\tsize:4;\tsigned:1;\n\tfield:u64 runtime;\toffset:16;\tsize:8;\tsigned:0;\n";
        let f = Format { category: "sched".into(), name: "sched_stat_runtime".into(), fields: parse_format(text) };
        assert_eq!(f.offsets(&["pid", "runtime"]).unwrap(), vec![8, 16]);
        let msg = format!("{:#}", f.offsets(&["pid", "vruntime", "runtime"]).unwrap_err());
        assert!(msg.contains("sched:sched_stat_runtime has no field `vruntime`"), "{msg}");
    }

    #[test]
    fn parses_sched_switch() {
        let text = "name: sched_switch\nID: 316\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\tfield:char prev_comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\tfield:pid_t prev_pid;\toffset:24;\tsize:4;\tsigned:1;\n\tfield:long prev_state;\toffset:32;\tsize:8;\tsigned:1;\n\tfield:__data_loc char[] cmd;\toffset:44;\tsize:4;\tsigned:0;\n";
        let f = parse_format(text);
        assert_eq!(f["prev_pid"], Field { offset: 24, size: 4 });
        assert_eq!(f["prev_state"], Field { offset: 32, size: 8 });
        assert_eq!(f["prev_comm"], Field { offset: 8, size: 16 });
        assert_eq!(f["cmd"], Field { offset: 44, size: 4 });
        assert_eq!(f["common_type"].offset, 0);
    }
}
