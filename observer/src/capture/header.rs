//! The facts written once at the start of a run (`model::RunHeader`): host,
//! kernel, CPU, memory, boot, target command line, model file, engine
//! configuration. `diff` uses them to warn about runs that are not comparable.

use std::{collections::BTreeMap, io::Read, path::Path};

use observer_common::model::{ModelInfo, RunHeader};

fn read_trim(p: &str) -> String {
    std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default()
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default()
}

/// MemTotal from /proc/meminfo, bytes.
pub fn mem_total() -> u64 {
    meminfo("MemTotal").unwrap_or(0)
}

/// A /proc/meminfo field in bytes.
pub fn meminfo(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k == key).then(|| v.split_whitespace().next()?.parse::<u64>().ok().map(|kb| kb * 1024))?
    })
}

/// CRC-32 of the first 4 MiB (header and tensor table) and the size: cheap,
/// and enough to tell two model files apart.
pub fn model_info(path: &Path) -> Option<ModelInfo> {
    let size = std::fs::metadata(path).ok()?.len();
    let mut f = std::fs::File::open(path).ok()?;
    let mut buf = vec![0u8; (4 << 20).min(size as usize)];
    f.read_exact(&mut buf).ok()?;
    let mut h = crc32fast::Hasher::new();
    h.update(&buf);
    h.update(&size.to_le_bytes());
    Some(ModelInfo { path: path.display().to_string(), size_bytes: size, hash: format!("crc32:{:08x}", h.finalize()) })
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

/// `--key value` and `--key=value` pairs of a command line (the engine's
/// configuration as the user gave it). Flags without a value map to "true".
pub fn config_from_command(cmd: &[String]) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    let mut i = 1;
    while i < cmd.len() {
        let a = &cmd[i];
        if let Some(k) = a.strip_prefix("--") {
            if let Some((k, v)) = k.split_once('=') {
                m.insert(k.to_string(), v.to_string());
            } else if let Some(v) = cmd.get(i + 1).filter(|v| !v.starts_with("--")) {
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

pub fn build(mode: &str, pid: u32, command: &[String], probes: Vec<String>, model: Option<&Path>) -> RunHeader {
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
        boot_id: read_trim("/proc/sys/kernel/random/boot_id"),
        started_unix_ns: now_unix,
        started_mono_ns: crate::capture::seed::mono_ns(),
        target_pid: pid,
        target_command: command.to_vec(),
        model: model_path.as_deref().map(Path::new).and_then(model_info),
        engine_config: config_from_command(command),
        probes,
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
}
