//! Process-level samples (`model::ProcessSample`): the target's RSS split and
//! swap from `/proc/PID/status`, and the machine's MemAvailable.

use observer_common::model::ProcessSample;

pub fn sample(pid: u32, mono_ns: u64) -> ProcessSample {
    let status = procfs::process::Process::new(pid as i32).and_then(|p| p.status()).ok();
    // `status` gives these in kB (KiB); absent (a kernel thread, or the process is gone) is `None`.
    let kib = |f: fn(&procfs::process::Status) -> Option<u64>| status.as_ref().and_then(f).map(|kb| kb * 1024);
    ProcessSample {
        mono_ns,
        rss_bytes: kib(|s| s.vmrss),
        rss_anon_bytes: kib(|s| s.rssanon),
        rss_file_bytes: kib(|s| s.rssfile),
        swap_bytes: kib(|s| s.vmswap),
        mem_available_bytes: crate::capture::header::meminfo("MemAvailable"),
        evicted_by_process: Vec::new(),
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
