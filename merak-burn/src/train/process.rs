//! This process's memory statistics, read from `/proc` (Linux; elsewhere they read as 0).

/// Minor page faults of this process so far (field 10 of `/proc/self/stat`): each one is a
/// page the kernel mapped, usually zeroed, for memory touched the first time. A training step
/// whose buffers are reused makes few.
pub fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // The command name (field 2) is in parentheses and may hold spaces.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Peak resident memory of this process in bytes (`VmHWM` of `/proc/self/status`).
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touching_fresh_memory_counts_faults_and_raises_the_peak() {
        let before = minor_faults();
        let v = vec![1u8; 64 << 20];
        assert!(v.iter().step_by(4096).all(|&b| b == 1));
        let after = minor_faults();
        assert!(after > before, "{before} -> {after}");
        assert!(peak_rss_bytes() >= 64 << 20);
    }
}
