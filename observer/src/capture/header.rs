//! The facts written once at the start of a run (`model::RunHeader`): host,
//! kernel, CPU, memory, boot, target command line, model file, engine
//! configuration. `diff` uses them to warn about runs that are not comparable.

use std::{collections::BTreeMap, io::Read, path::Path};

use observer_common::model::{ModelInfo, RunHeader};

/// A one-value sysctl file, trimmed (procfs has parsers for structured files; these are plain text).
fn read_trim(p: &str) -> String {
    std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default()
}

fn cpu_model() -> String {
    use procfs::Current;
    procfs::CpuInfo::current().ok().and_then(|c| c.model_name(0).map(str::to_string)).unwrap_or_default()
}

/// MemTotal from /proc/meminfo, bytes.
pub fn mem_total() -> u64 {
    meminfo("MemTotal").unwrap_or(0)
}

/// A /proc/meminfo field in bytes, read by procfs: the fields the observer uses (`MemTotal`,
/// `MemFree`, `MemAvailable`, `SwapTotal`, `SwapFree`); `None` for others or when not present.
pub fn meminfo(key: &str) -> Option<u64> {
    use procfs::Current;
    let m = procfs::Meminfo::current().ok()?;
    match key {
        "MemTotal" => Some(m.mem_total),
        "MemFree" => Some(m.mem_free),
        "MemAvailable" => m.mem_available,
        "SwapTotal" => Some(m.swap_total),
        "SwapFree" => Some(m.swap_free),
        _ => None,
    }
}

/// CRC-32 of the first 4 MiB (header and tensor table) and the size: cheap,
/// and enough to tell two model files apart. Read with `O_DIRECT` where the file system
/// allows it, so that the run does not warm the model it is about to measure
/// (`residency::direct`).
pub fn model_info(path: &Path) -> Option<ModelInfo> {
    let mut f = engine::files::open_regular(path).ok()?;
    let size = f.metadata().ok()?.len();
    let n = (4u64 << 20).min(size);
    let buf = match crate::capture::residency::direct::read_prefix(path, n).ok()? {
        Some(b) if b.len() as u64 == n => b,
        _ => {
            let mut b = vec![0u8; n as usize];
            f.read_exact(&mut b).ok()?;
            b
        }
    };
    let mut h = crc32fast::Hasher::new();
    h.update(&buf);
    h.update(&size.to_le_bytes());
    Some(ModelInfo {
        path: path.display().to_string(),
        size_bytes: size,
        hash: format!("crc32:{:08x}", h.finalize()),
        page_bytes: Some(crate::capture::residency::scan::page_size()),
    })
}

/// The model a command line names: `--model F`, `-m F`, or any `*.gguf` argument.
pub fn model_from_command(cmd: &[String]) -> Option<String> {
    let mut it = cmd.iter().peekable();
    while let Some(a) = it.next() {
        if (a == "--model" || a == "-m")
            && let Some(v) = it.peek()
        {
            return Some((*v).clone());
        }
        if let Some(v) = a.strip_prefix("--model=") {
            return Some(v.to_string());
        }
    }
    cmd.iter().find(|a| a.ends_with(".gguf")).cloned()
}

/// The engine's configuration as the user gave it on the command line. The
/// embedded engine's command line is read by its own flag table
/// (`engine::cli::config_of`); any other is read as `--key value` and
/// `--key=value` pairs, a flag followed by another flag (or by nothing)
/// mapping to "true".
pub fn config_from_command(cmd: &[String]) -> BTreeMap<String, String> {
    let is_engine = cmd.first().and_then(|p| Path::new(p).file_name()).is_some_and(|n| n == "engine");
    if is_engine && let Some(c) = engine::cli::config_of(cmd) {
        return c;
    }
    let mut m = BTreeMap::new();
    let mut i = 1;
    while i < cmd.len() {
        let a = &cmd[i];
        if let Some(k) = a.strip_prefix("--") {
            if let Some((k, v)) = k.split_once('=') {
                m.insert(k.to_string(), v.to_string());
            } else if let Some(v) = cmd.get(i + 1).filter(|v| !v.starts_with('-') || v.parse::<f64>().is_ok()) {
                m.insert(k.to_string(), v.clone());
                i += 1;
            } else {
                m.insert(k.to_string(), "true".into());
            }
        }
        i += 1;
    }
    m
}

/// The run's header; `model` is the model file when known (else the one the
/// command line names), `tokens` what marks the tokens.
pub fn build(
    mode: &str,
    pid: u32,
    command: &[String],
    probes: Vec<String>,
    model: Option<&Path>,
    tokens: String,
    degraded: Vec<String>,
) -> RunHeader {
    let now_unix =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let model_path = model.map(|p| p.display().to_string()).or_else(|| model_from_command(command));
    RunHeader {
        observer_version: env!("CARGO_PKG_VERSION").into(),
        mode: mode.into(),
        kernel: read_trim("/proc/sys/kernel/osrelease"),
        host: read_trim("/proc/sys/kernel/hostname"),
        cpu_model: cpu_model(),
        n_cpus: std::thread::available_parallelism().map(|n| n.get() as u32).unwrap_or(0),
        mem_total_bytes: mem_total(),
        boot_id: procfs::sys::kernel::random::boot_id().map(|b| b.trim().to_string()).unwrap_or_default(),
        started_unix_ns: now_unix,
        started_mono_ns: crate::capture::seed::mono_ns(),
        target_pid: pid,
        target_command: command.to_vec(),
        model: model_path.as_deref().map(Path::new).and_then(model_info),
        engine_config: config_from_command(command),
        probes,
        tokens,
        degraded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn finds_the_model_and_the_configuration() {
        let c = v(&["engine", "run", "--model", "/m/a.gguf", "--dense", "anon", "-n", "8", "--json", "--threads=2"]);
        assert_eq!(model_from_command(&c).as_deref(), Some("/m/a.gguf"));
        let cfg = config_from_command(&c);
        assert_eq!(cfg["dense"], "anon");
        assert_eq!(cfg["threads"], "2");
        assert_eq!(cfg["json"], "true");
        assert_eq!(model_from_command(&v(&["llama-cli", "x.gguf"])).as_deref(), Some("x.gguf"));
        assert_eq!(model_from_command(&v(&["sleep", "1"])), None);
    }

    /// Issue 19: `--ignore-eos -t 2` was read as `ignore-eos=-t`.
    #[test]
    fn the_engine_command_line_is_read_by_the_engine_flag_table() {
        let c = v(&["/x/engine", "run", "-m", "/m/a.gguf", "-p", "hi", "-n", "17", "--ignore-eos", "-t", "2"]);
        let cfg = config_from_command(&c);
        assert_eq!(cfg["ignore-eos"], "true");
        assert_eq!(cfg["threads"], "2");
        assert_eq!(cfg["n"], "17");
        assert_eq!(cfg["model"], "/m/a.gguf");
        // Another program: no table, but a flag is never taken as a value; a number is.
        let cfg = config_from_command(&v(&["llama-cli", "--ignore-eos", "-t", "2", "--temp", "-1", "--flash"]));
        assert_eq!(cfg["ignore-eos"], "true");
        assert_eq!(cfg["temp"], "-1");
        assert_eq!(cfg["flash"], "true");
    }

    #[test]
    fn mem_total_is_what_sysinfo_says() {
        // Independent source: sysinfo(2), the kernel's totalram_pages (what MemTotal prints).
        // SAFETY: a zeroed sysinfo is a valid out-parameter.
        let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer.
        assert_eq!(unsafe { libc::sysinfo(&mut si) }, 0);
        assert_eq!(mem_total(), si.totalram as u64 * u64::from(si.mem_unit));
        assert!(meminfo("MemAvailable").is_some_and(|a| a > 0 && a <= mem_total()));
        assert_eq!(meminfo("NoSuchField"), None);
    }
}
