//! An ftrace instance of a benchmark's own: chosen tracepoints, the engine's token begins (an
//! ftrace uprobe on its `moe_engine_token_begin` marker, printed as `token_begin: (0x…) index=N`)
//! and the benchmark's own marks (`trace_marker`, printed as `tracing_mark_write: TEXT`), all on
//! one clock (`mono`). Not `perf record`: while a BPF program on the same tracepoint returns 0
//! (the observer's do), the kernel hands the event to no perf listener; the ftrace ring buffer
//! gets it regardless. The instance and the uprobe event are removed when the record is dropped;
//! a buffer that overflowed is an error, never a shorter record.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

pub const TRACEFS: &str = "/sys/kernel/tracing";
/// The scheduler's events (under `events/` of the instance) that [`crate::displace`] reads.
pub const SCHED_EVENTS: [&str; 3] = ["sched/sched_switch", "sched/sched_migrate_task", "sched/sched_wakeup"];

/// The engine binary and its token-begin marker's file offset ([`marker_file_offset`]).
pub struct Marker {
    pub engine: PathBuf,
    pub offset: u64,
}

impl Marker {
    pub fn token_begin(engine: &Path) -> Result<Marker> {
        Ok(Marker { engine: engine.to_path_buf(), offset: marker_file_offset(engine, "moe_engine_token_begin")? })
    }
}

pub struct Record {
    dir: PathBuf,
    events: Vec<String>,
    /// The uprobe event's `group/name`, once defined.
    uprobe: Option<String>,
}

impl Record {
    /// A new instance `NAME-PID` recording `events` and the engine's token begins.
    pub fn start(name: &str, events: &[&str], marker: &Marker) -> Result<Record> {
        let dir = Path::new(TRACEFS).join(format!("instances/{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).with_context(|| {
            format!("creating the ftrace instance {} (tracefs; `cargo xtask setup` mounts it)", dir.display())
        })?;
        let mut rec = Record { dir, events: Vec::new(), uprobe: None };
        // 2 x 32 MiB: about 10 minutes of a busy 2-core machine's switches.
        rec.write("buffer_size_kb", "32768")?;
        rec.write("trace_clock", "mono")?;
        for e in events {
            rec.write(&format!("events/{e}/enable"), "1")?;
            rec.events.push(e.to_string());
        }
        let event = format!("{}_{}/token_begin", name.replace('-', "_"), std::process::id());
        // Appended: a plain write would delete every other uprobe event defined through tracefs.
        append_uprobe_event(&format!("p:{event} {}:{:#x} index=%di:u64", marker.engine.display(), marker.offset))?;
        rec.uprobe = Some(event.clone());
        rec.write(&format!("events/{event}/enable"), "1")?;
        Ok(rec)
    }

    fn write(&self, file: &str, v: &str) -> Result<()> {
        let p = self.dir.join(file);
        std::fs::write(&p, v).with_context(|| format!("writing {v} to {}", p.display()))
    }

    /// A line of the benchmark's own in the record, at this moment.
    pub fn mark(&self, text: &str) -> Result<()> {
        self.write("trace_marker", text)
    }

    /// Stops the record and returns its text.
    pub fn finish(self) -> Result<String> {
        self.write("tracing_on", "0")?;
        let p = self.dir.join("trace");
        let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        // `# entries-in-buffer/entries-written: 1234/1234`: fewer in the buffer means lost events.
        if let Some(counts) = text.lines().find_map(|l| l.strip_prefix("# entries-in-buffer/entries-written: "))
            && let Some((kept, written)) = counts.split_whitespace().next().and_then(|c| c.split_once('/'))
            && kept != written
        {
            bail!("the ftrace buffer of {} overflowed ({kept} of {written} events kept)", self.dir.display());
        }
        Ok(text)
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        for e in self.events.iter().chain(self.uprobe.as_ref()) {
            let _ = std::fs::write(self.dir.join(format!("events/{e}/enable")), "0");
        }
        let _ = std::fs::remove_dir(&self.dir);
        if let Some(event) = &self.uprobe {
            let _ = append_uprobe_event(&format!("-:{event}"));
        }
    }
}

/// The benchmark's marks in a record's text: (time, text) in order.
pub fn marks(text: &str) -> Vec<(f64, String)> {
    text.lines()
        .filter_map(|l| {
            let (head, mark) = l.split_once(": tracing_mark_write: ")?;
            let t = head.rsplit(' ').next()?.parse::<f64>().ok()?;
            Some((t, mark.trim_end().to_string()))
        })
        .collect()
}

fn append_uprobe_event(line: &str) -> Result<()> {
    use std::io::Write;
    let p = Path::new(TRACEFS).join("uprobe_events");
    std::fs::OpenOptions::new()
        .append(true)
        .open(&p)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()))
        .with_context(|| format!("writing `{line}` to {} (a kernel with CONFIG_UPROBE_EVENTS)", p.display()))
}

/// Where `symbol`'s first instruction is in the ELF file `path` (the offset an ftrace uprobe
/// takes).
fn marker_file_offset(path: &Path, symbol: &str) -> Result<u64> {
    use object::{Object, ObjectSegment, ObjectSymbol};
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = object::File::parse(&*data).with_context(|| format!("{} is not an ELF file", path.display()))?;
    let addr = file
        .symbols()
        .chain(file.dynamic_symbols())
        .find(|s| s.name() == Ok(symbol) && s.is_definition())
        .map(|s| s.address())
        .with_context(|| format!("{} does not define {symbol}", path.display()))?;
    file.segments()
        .find_map(|s| {
            let (a, size) = (s.address(), s.size());
            (addr >= a && addr < a + size).then(|| s.file_range().0 + (addr - a))
        })
        .with_context(|| format!("{symbol} of {} is in no loaded segment", path.display()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn marks_are_read_with_their_times() {
        let text = "# tracer: nop\n\
            \x20         xtask-812     [001] .....  4711.250001: tracing_mark_write: on 3\n\
            \x20        engine-900     [000] ...1.  4711.250100: token_begin: (0x5555) index=7\n\
            \x20         xtask-812     [000] .....  4712.5: tracing_mark_write: off 3\n";
        assert_eq!(super::marks(text), [(4711.250001, "on 3".to_string()), (4712.5, "off 3".to_string())]);
    }
}
