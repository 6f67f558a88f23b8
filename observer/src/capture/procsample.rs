//! Process-level samples (`model::ProcessSample`): the target's RSS split and
//! swap from `/proc/PID/status`, and the machine's MemAvailable.

use observer_common::model::ProcessSample;

fn status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse::<u64>().ok().map(|kb| kb * 1024)
    })
}

pub fn sample(pid: u32, mono_ns: u64) -> ProcessSample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    ProcessSample {
        mono_ns,
        rss_bytes: status_kib(&status, "VmRSS"),
        rss_anon_bytes: status_kib(&status, "RssAnon"),
        rss_file_bytes: status_kib(&status, "RssFile"),
        swap_bytes: status_kib(&status, "VmSwap"),
        mem_available_bytes: crate::capture::header::meminfo("MemAvailable"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_this_process() {
        let s = sample(std::process::id(), 1);
        assert!(s.rss_bytes.unwrap() > 0);
        assert!(s.rss_anon_bytes.is_some() && s.swap_bytes.is_some());
        assert!(s.mem_available_bytes.unwrap() > 0);
        // A PID that does not exist measures nothing (never 0).
        let none = sample(u32::MAX - 1, 1);
        assert_eq!(none.rss_bytes, None);
    }
}
