//! Number formatting and the palette shared by the views.

use observer_common::model::Component;
use ratatui::style::{Color, Modifier, Style};

/// What a view prints for a value that was not measured.
pub const NA: &str = "–";

/// Milliseconds from nanoseconds, two decimals (none from 10 s up).
pub fn ms(ns: f64) -> String {
    let v = ns / 1e6;
    if v.abs() >= 10_000.0 { format!("{v:.0}") } else { format!("{v:.2}") }
}

pub fn opt_ms(ns: Option<f64>) -> String {
    ns.map_or_else(|| NA.to_string(), ms)
}

/// Signed milliseconds (`+8.30`, `−0.12`).
pub fn signed_ms(ns: f64) -> String {
    let s = ms(ns.abs());
    if ns < 0.0 { format!("−{s}") } else { format!("+{s}") }
}

/// A count with one decimal (per-token means), thousands as `k`/`M` when large.
pub fn count(v: f64) -> String {
    let a = v.abs();
    if a >= 10e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 100e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.1}")
    }
}

/// An integer, with `k`/`M`/`G` from ten thousand up.
pub fn int(v: u64) -> String {
    match v {
        0..10_000 => v.to_string(),
        10_000..10_000_000 => format!("{:.1}k", v as f64 / 1e3),
        10_000_000..10_000_000_000 => format!("{:.2}M", v as f64 / 1e6),
        _ => format!("{:.2}G", v as f64 / 1e9),
    }
}

pub fn opt_count(v: Option<f64>) -> String {
    v.map_or_else(|| NA.to_string(), count)
}

/// Bytes in binary units.
pub fn bytes(v: f64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut i = 0;
    while v.abs() >= 1024.0 && i + 1 < U.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 { format!("{v:.0} B") } else { format!("{v:.2} {}", U[i]) }
}

pub fn opt_bytes(v: Option<f64>) -> String {
    v.map_or_else(|| NA.to_string(), bytes)
}

/// A duration bound for a histogram bucket (`512 ns`, `2 µs`, `4.2 ms`, `1.1 s`).
pub fn duration_ns(ns: u64) -> String {
    let v = ns as f64;
    if ns < 1_000 {
        format!("{ns} ns")
    } else if ns < 1_000_000 {
        trim(v / 1e3, "µs")
    } else if ns < 1_000_000_000 {
        trim(v / 1e6, "ms")
    } else {
        trim(v / 1e9, "s")
    }
}

fn trim(v: f64, unit: &str) -> String {
    if v >= 100.0 { format!("{v:.0} {unit}") } else { format!("{v:.1} {unit}") }
}

pub fn pct(frac: f64) -> String {
    format!("{:.1} %", frac * 100.0)
}

/// Cut `s` to `w` columns, marking the cut with `…`.
pub fn fit(s: &str, w: usize) -> String {
    let n = s.chars().count();
    if n <= w {
        s.to_string()
    } else if w == 0 {
        String::new()
    } else {
        let mut out: String = s.chars().take(w - 1).collect();
        out.push('…');
        out
    }
}

/// One colour per component, the same in every view.
pub const fn color(c: Component) -> Color {
    match c {
        Component::Compute => Color::Green,
        Component::FaultMinor => Color::Yellow,
        Component::SwapinZram => Color::Magenta,
        Component::FaultIo => Color::Red,
        Component::IoWait => Color::LightRed,
        Component::IoWaitPeer => Color::LightMagenta,
        Component::Reclaim => Color::LightYellow,
        Component::Syscall => Color::Blue,
        Component::Runqueue => Color::Cyan,
        Component::Sleep => Color::DarkGray,
        Component::Unattributed => Color::LightBlue,
    }
}

/// The residual: time no component accounts for (wall − Σ components).
pub const RESIDUAL: Color = Color::Gray;

pub fn title() -> Style {
    Style::new().add_modifier(Modifier::BOLD)
}

pub fn dim() -> Style {
    Style::new().fg(Color::DarkGray)
}

pub fn alarm() -> Style {
    Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(ms(82_640_000.0), "82.64");
        assert_eq!(ms(12_345_000_000.0), "12345");
        assert_eq!(signed_ms(-120_000.0), "−0.12");
        assert_eq!(signed_ms(8_300_000.0), "+8.30");
        assert_eq!(count(1234.56), "1234.6");
        assert_eq!(count(250_000.0), "250.0k");
        assert_eq!(int(9_999), "9999");
        assert_eq!(int(1_858_822), "1858.8k");
        assert_eq!(int(18_588_220), "18.59M");
        assert_eq!(bytes(1536.0), "1.50 KiB");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0 * 1024.0), "3.00 GiB");
        assert_eq!(bytes(12.0), "12 B");
        assert_eq!(duration_ns(512), "512 ns");
        assert_eq!(duration_ns(2048), "2.0 µs");
        assert_eq!(duration_ns(1 << 22), "4.2 ms");
        assert_eq!(duration_ns(1 << 38), "275 s");
        assert_eq!(fit("abcdef", 4), "abc…");
        assert_eq!(fit("abc", 4), "abc");
        assert_eq!(fit("abc", 0), "");
    }
}
