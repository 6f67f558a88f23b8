//! Import of `bmoe_metrics v1` CSV files (the per-token telemetry written by
//! the BigMoeOnEdge engine) into the model stream.
//!
//! ## Input format
//! ```text
//! # bmoe_metrics v1
//! # model=… arch=… n_layer=… n_expert=… n_expert_used=… threads=… n_ctx=…
//! # moe_stream=… cache_mb=… io_threads=… o_direct=… overlap=… prefetch=… dense_weights=…
//! step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms,majflt,cpu_ms,…
//! 1,2048,640.444,577.944,…
//! ```
//! Columns are found by name (order does not matter; only `wall_ms` is
//! required). `-1` means *not measured* and becomes `None`.
//!
//! ## Mapping
//! - The two `#` lines → `RunHeader::engine_config` (every `key=value`, the
//!   model's name included); `mode` is `import:bmoe_metrics v1`. Host, kernel,
//!   CPU and boot are unknown (empty). The start time comes from a file name
//!   `bmoe-YYYYMMDD-HHMMSS…` (the phone's local time, taken as UTC: good for
//!   "same day" and "back to back", not for time zones).
//! - Each row → one generated-token `TokenRecord`: `wall_ns` from `wall_ms`,
//!   `index` = `step`; the observer's components and counters are `None` (not
//!   measured), so `residual_ns` = wall; `start_ns` = the sum of the previous
//!   rows' walls (the file has no timestamps). The engine's columns go to
//!   `EngineTelemetry` (`compute_ms` also to `engine_compute_ns`); MiB columns
//!   are converted to bytes. `steps`, `turn`, `majflt_mib`,
//!   `cache_budget_mib`, `mem_free_mib` and `swap_free_mib` have no place in
//!   the model and are not carried.
//! - An `End` closes the stream, `mono_ns` = Σ wall, no exit code.
//! - A last row cut short (no newline, too few fields) is skipped and reported
//!   as a truncation; any other malformed row is an error naming the line, as
//!   is a time column over a day (`MAX_MS`) for one token.

use std::{collections::BTreeMap, path::Path};

use observer_common::model::{EngineTelemetry, Event, RunEnd, RunHeader, StepKind, TokenRecord};

use super::ImportError;

pub const MAGIC_LINE: &str = "# bmoe_metrics v1";

const MIB: f64 = 1024.0 * 1024.0;

/// The longest time a column may give one token: a day. Beyond is no measurement, and a sum of
/// such walls overflowed the run's clock (found by fuzzing: `fuzz/corpus/bmoe/wall-ms-sum-overflowed`).
const MAX_MS: f64 = 86_400_000.0;

/// Does `text` start like a bmoe_metrics file (any version)?
pub fn sniff(text: &[u8]) -> bool {
    text.starts_with(b"# bmoe_metrics")
}

/// Parse a bmoe_metrics v1 file; returns the events and the reading notes
/// (a skipped truncated last row).
pub fn parse(path: &Path, text: &str) -> Result<(Vec<Event>, Vec<String>), ImportError> {
    let err = |line: usize, msg: String| ImportError::Bmoe { path: path.to_path_buf(), line, msg };
    let mut lines = text.split_inclusive('\n').enumerate().map(|(i, l)| (i + 1, l));
    let (_, first) = lines.next().ok_or_else(|| err(1, "empty file".into()))?;
    let first = first.trim();
    if first != MAGIC_LINE {
        return Err(err(1, format!("expected `{MAGIC_LINE}`, found `{first}` (only version 1 is supported)")));
    }
    let mut config = BTreeMap::new();
    let mut header_line = None;
    for (n, raw) in lines.by_ref() {
        let l = raw.trim();
        if l.is_empty() {
            continue;
        }
        if let Some(kv) = l.strip_prefix('#') {
            for item in kv.split_whitespace() {
                let (k, v) =
                    item.split_once('=').ok_or_else(|| err(n, format!("expected key=value pairs, found `{item}`")))?;
                if let Some(old) = config.insert(k.to_string(), v.to_string())
                    && old != v
                {
                    return Err(err(n, format!("`{k}` is given twice ({old} and {v})")));
                }
            }
            continue;
        }
        header_line = Some((n, l.to_string()));
        break;
    }
    let (hn, header) = header_line.ok_or_else(|| err(2, "no CSV header line (step,steps,wall_ms,…)".into()))?;
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |name: &str| cols.iter().position(|c| *c == name);
    let wall_col = col("wall_ms").ok_or_else(|| err(hn, "the CSV header has no `wall_ms` column".into()))?;

    let mut events = vec![Event::Header(RunHeader {
        mode: format!("import:{}", &MAGIC_LINE[2..]),
        started_unix_ns: start_from_name(path).unwrap_or(0),
        engine_config: config,
        ..RunHeader::default()
    })];
    let mut notes = Vec::new();
    let mut t = 0u64;
    let mut seq = 0u64;
    let mut rows = lines.peekable();
    while let Some((n, raw)) = rows.next() {
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = l.split(',').map(str::trim).collect();
        let is_last = rows.peek().is_none_or(|(_, r)| r.trim().is_empty()) && !raw.ends_with('\n');
        if fields.len() != cols.len() {
            if is_last && fields.len() < cols.len() {
                notes.push(format!(
                    "{}: line {n} is cut short ({} of {} fields, no newline): skipped as a truncated last row",
                    path.display(),
                    fields.len(),
                    cols.len()
                ));
                break;
            }
            return Err(err(n, format!("{} fields, the header has {}", fields.len(), cols.len())));
        }
        let num = |name: &str| -> Result<Option<f64>, ImportError> {
            let Some(i) = col(name) else { return Ok(None) };
            let s = fields[i];
            let v: f64 = s.parse().map_err(|_| err(n, format!("column `{name}`: `{s}` is not a number")))?;
            if v == -1.0 {
                return Ok(None);
            }
            if !v.is_finite() || v < 0.0 {
                return Err(err(
                    n,
                    format!("column `{name}`: {s} is negative or not finite (only -1, not measured, may be)"),
                ));
            }
            Ok(Some(v))
        };
        let ns = |name: &str| -> Result<Option<u64>, ImportError> {
            match num(name)? {
                Some(ms) if ms > MAX_MS => {
                    Err(err(n, format!("column `{name}`: {ms} ms is more than a day for one token")))
                }
                v => Ok(v.map(|ms| (ms * 1e6).round() as u64)),
            }
        };
        let mib = |name: &str| -> Result<Option<u64>, ImportError> { Ok(num(name)?.map(|m| (m * MIB).round() as u64)) };
        let wall_ns = ns("wall_ms")?.ok_or_else(|| {
            err(n, format!("column `wall_ms` is `{}`: every row needs a wall time", fields[wall_col]))
        })?;
        let engine = EngineTelemetry {
            wall_ns: Some(wall_ns),
            compute_ns: ns("compute_ms")?,
            io_ns: ns("io_ms")?,
            stall_ns: ns("stall_ms")?,
            mgmt_ns: ns("mgmt_ms")?,
            read_bytes: num("read_bytes")?.map(|v| v.round() as u64),
            cache_hit_pct: num("cache_hit_pct")?,
            majflt: num("majflt")?.map(|v| v.round() as u64),
            cpu_ns: ns("cpu_ms")?,
            dense_resident_frac: num("dense_resident_frac")?,
            rss_bytes: mib("rss_mib")?,
            rss_anon_bytes: mib("rss_anon_mib")?,
            rss_file_bytes: mib("rss_file_mib")?,
            swap_bytes: mib("swap_mib")?,
            mem_available_bytes: mib("mem_available_mib")?,
        };
        events.push(Event::Token(TokenRecord {
            seq,
            index: num("step")?.map(|v| v as u64),
            kind: StepKind::Generate,
            n_tokens: 1,
            start_ns: t,
            wall_ns,
            components: Default::default(),
            residual_ns: wall_ns as i64,
            counters: Default::default(),
            engine_compute_ns: engine.compute_ns,
            threads: Vec::new(),
            engine: Some(engine),
            residency: None,
            lost_events: 0,
            evicted_by: None,
            refaults: None,
            explicit_reads: None,
        }));
        seq += 1;
        t = t
            .checked_add(wall_ns)
            .ok_or_else(|| err(n, "the rows' wall times add up to more than 584 years".into()))?;
    }
    if seq == 0 {
        return Err(err(hn, "no token rows after the header".into()));
    }
    events.push(Event::End(RunEnd { mono_ns: t, exit_code: None, lost_events: 0 }));
    Ok((events, notes))
}

/// `bmoe-20260721-090406.csv` → Unix ns of 2026-07-21 09:04:06 (as UTC).
fn start_from_name(path: &Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("bmoe-")?;
    let digits: Vec<u8> = rest.bytes().take(15).collect();
    if digits.len() < 15 || digits[8] != b'-' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> { std::str::from_utf8(&digits[r]).ok()?.parse().ok() };
    let (y, mo, d) = (num(0..4)?, num(4..6)?, num(6..8)?);
    let (h, mi, s) = (num(9..11)?, num(11..13)?, num(13..15)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let days = days_from_civil(y, mo, d);
    let secs = days * 86_400 + h * 3600 + mi * 60 + s;
    u64::try_from(secs).ok().map(|s| s * 1_000_000_000)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "# bmoe_metrics v1\n# model=m.gguf threads=4\n# cache_mb=3000 dense_weights=anon\n\
step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,majflt,dense_resident_frac,rss_mib\n\
1,2048,640.444,577.944,471.629,388349952,3.31,7602,-1.000,4876.8\n\
2,2048,299.528,561.900,147.154,375877632,6.25,1,0.852,4827.5\n";

    fn tokens(ev: &[Event]) -> Vec<&TokenRecord> {
        ev.iter().filter_map(|e| if let Event::Token(t) = e { Some(t) } else { None }).collect()
    }

    #[test]
    fn maps_rows_and_configuration() {
        let (ev, notes) = parse(Path::new("bmoe-20260721-090406.csv"), SAMPLE).unwrap();
        assert!(notes.is_empty());
        let Event::Header(h) = &ev[0] else { panic!("header first") };
        assert_eq!(h.engine_config["dense_weights"], "anon");
        assert_eq!(h.engine_config["model"], "m.gguf");
        assert_eq!(h.mode, "import:bmoe_metrics v1");
        // 2026-07-21 09:04:06 UTC (date -u -d '2026-07-21 09:04:06' +%s = 1784624646).
        assert_eq!(h.started_unix_ns, 1_784_624_646_000_000_000);
        let t = tokens(&ev);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].wall_ns, 640_444_000);
        assert_eq!(t[1].start_ns, 640_444_000);
        assert_eq!(t[0].index, Some(1));
        assert_eq!(t[0].engine_compute_ns, Some(471_629_000));
        let e0 = t[0].engine.as_ref().unwrap();
        assert_eq!(e0.dense_resident_frac, None, "-1 is not measured");
        assert_eq!(t[1].engine.as_ref().unwrap().dense_resident_frac, Some(0.852));
        assert_eq!(e0.read_bytes, Some(388_349_952));
        assert_eq!(e0.majflt, Some(7602));
        assert_eq!(e0.stall_ns, None, "absent column");
        assert_eq!(e0.rss_bytes, Some((4876.8 * MIB).round() as u64));
        assert!(t[0].components.iter().all(|(_, v)| v.is_none()), "the observer measured nothing");
        assert!(matches!(ev.last(), Some(Event::End(e)) if e.mono_ns == 640_444_000 + 299_528_000));
    }

    #[test]
    fn a_cut_last_row_is_skipped_and_reported() {
        let cut = &SAMPLE[..SAMPLE.len() - 20];
        let (ev, notes) = parse(Path::new("x.csv"), cut).unwrap();
        assert_eq!(tokens(&ev).len(), 1);
        assert_eq!(notes.len(), 1);
        assert!(notes[0].contains("line 6 is cut short"), "{notes:?}");
    }

    #[test]
    fn malformed_input_names_the_line() {
        let bad = SAMPLE.replace("299.528", "fast");
        let e = parse(Path::new("x.csv"), &bad).unwrap_err().to_string();
        assert!(e.contains("x.csv:6") && e.contains("`fast` is not a number"), "{e}");
        let e = parse(Path::new("x.csv"), "# bmoe_metrics v2\n").unwrap_err().to_string();
        assert!(e.contains("x.csv:1") && e.contains("only version 1"), "{e}");
        let e = parse(Path::new("x.csv"), &SAMPLE.replace("1,2048,640.444,", "1,2048,")).unwrap_err().to_string();
        assert!(e.contains("x.csv:5") && e.contains("fields"), "{e}");
        let e = parse(Path::new("x.csv"), &SAMPLE.replace("299.528", "-1")).unwrap_err().to_string();
        assert!(e.contains("wall_ms"), "{e}");
    }

    #[test]
    fn civil_days() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    /// Found by libFuzzer (`fuzz/corpus/bmoe/wall-ms-sum-overflowed`): walls of ~1e300 ms
    /// overflowed the sum of the rows' times. A time over a day is an error naming the line.
    #[test]
    fn a_time_over_a_day_is_an_error_not_an_overflow() {
        let data = include_bytes!("../../../../fuzz/corpus/bmoe/wall-ms-sum-overflowed");
        let text = String::from_utf8_lossy(data);
        assert!(parse(Path::new("f.csv"), &text).is_err());
        let ok = "# bmoe_metrics v1\n# m=1\n# c=1\nstep,wall_ms\n1,86400000\n2,5\n";
        assert_eq!(parse(Path::new("f.csv"), ok).unwrap().0.len(), 4);
        let e = parse(Path::new("f.csv"), "# bmoe_metrics v1\n# m=1\n# c=1\nstep,wall_ms\n1,5\n2,86400001\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("f.csv:6") && e.contains("wall_ms") && e.contains("more than a day"), "{e}");
    }
}
