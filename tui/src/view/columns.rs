//! Table columns: which of the vocabulary's quantities a view shows.
//!
//! ## Spec
//! A view's candidate columns are rows of the vocabulary (`observer_common::vocab`), in its order:
//! the time components, then the counters the kernel keeps per thread (the `COUNTERS` rows with
//! a slot). One rule ([`choose`]) decides which are shown, for every view:
//! - a column that no row of the view measured (`None` everywhere: named ahead of its
//!   measurement, or absent from the stream) is left out;
//! - a column measured and exactly zero on every row of the view is left out, and named in the
//!   view's note ([`Chosen::note`]: `all zero: io_wait unattr`), so that a hidden column is never
//!   taken for an unmeasured one;
//! - a view with no rows yet shows the columns this observer measures (none is known to be zero).
//!
//! Then the view leaves out, from the right, the columns its width cannot hold. A column's label
//! is the row's `short`; its width and number format follow from the row's kind (a time in ms, a
//! count, bytes).

use observer_common::{
    model::{Component, Counter},
    vocab::{Row, Unit},
};

use super::fmt;

/// One column: a time component or a counter of the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Column {
    Time(Component),
    Count(Counter),
}

impl Column {
    /// The time components, in the vocabulary's order.
    pub fn times() -> impl Iterator<Item = Column> {
        Component::ALL.into_iter().map(Column::Time)
    }

    /// The counters the kernel keeps per thread, in the vocabulary's order.
    pub fn per_thread_counts() -> impl Iterator<Item = Column> {
        Counter::ALL.into_iter().filter(|c| c.slot().is_some()).map(Column::Count)
    }

    pub fn row(self) -> &'static Row {
        match self {
            Column::Time(c) => c.row(),
            Column::Count(c) => c.row(),
        }
    }

    pub fn short(self) -> &'static str {
        self.row().short
    }

    fn bytes(self) -> bool {
        self.row().prom.is_some_and(|s| s.family.unit == Some(Unit::Bytes))
    }

    /// Cells, label included, right-aligned with one space of gap.
    pub fn width(self) -> usize {
        match self {
            Column::Time(_) => 8,
            Column::Count(_) if self.bytes() => 11,
            Column::Count(_) => 9,
        }
    }

    /// A value in the column's unit: ms from ns, a count, or bytes; `–` when not measured.
    pub fn format(self, v: Option<f64>) -> String {
        match self {
            Column::Time(_) => fmt::opt_ms(v),
            Column::Count(_) if self.bytes() => fmt::opt_bytes(v),
            Column::Count(_) => fmt::opt_count(v),
        }
    }
}

/// What a view shows of its candidate columns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chosen {
    pub shown: Vec<Column>,
    /// Measured, and zero on every row.
    pub zero: Vec<Column>,
}

impl Chosen {
    /// Keep the leading columns whose widths fit in `room` cells.
    pub fn fit(&mut self, room: usize) {
        let mut used = 0;
        let n = self.shown.iter().take_while(|c| {
            used += c.width();
            used <= room
        });
        let n = n.count();
        self.shown.truncate(n);
    }

    /// ` · all zero: io_wait unattr`, or nothing.
    pub fn note(&self) -> String {
        if self.zero.is_empty() {
            return String::new();
        }
        let names: Vec<&str> = self.zero.iter().map(|c| c.short()).collect();
        format!(" · all zero: {}", names.join(" "))
    }
}

/// The rule of the module spec. `total(c)` is the column's sum over the view's rows, `None` when
/// no row measured it; `has_rows` says whether the view has any row yet.
pub fn choose(
    candidates: impl IntoIterator<Item = Column>,
    has_rows: bool,
    total: impl Fn(Column) -> Option<f64>,
) -> Chosen {
    let mut out = Chosen::default();
    for c in candidates {
        if !has_rows {
            if c.row().measured() {
                out.shown.push(c);
            }
            continue;
        }
        match total(c) {
            None => {}
            Some(0.0) => out.zero.push(c),
            Some(_) => out.shown.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_columns_are_hidden_and_named_unmeasured_ones_only_hidden() {
        let total = |c: Column| match c {
            Column::Time(Component::Compute) => Some(5.0),
            Column::Time(Component::IoWait) => Some(0.0),
            Column::Time(Component::Sleep) => None,
            Column::Count(Counter::MajfltSwap) => Some(0.0),
            _ => Some(1.0),
        };
        let ch = choose(
            [Component::Compute, Component::IoWait, Component::Sleep]
                .map(Column::Time)
                .into_iter()
                .chain([Counter::MajfltFile, Counter::MajfltSwap].map(Column::Count)),
            true,
            total,
        );
        assert_eq!(ch.shown, vec![Column::Time(Component::Compute), Column::Count(Counter::MajfltFile)]);
        assert_eq!(ch.zero, vec![Column::Time(Component::IoWait), Column::Count(Counter::MajfltSwap)]);
        assert_eq!(ch.note(), " · all zero: io_wait majS");
    }

    #[test]
    fn before_any_row_the_measured_columns_show() {
        let ch = choose(Column::times(), false, |_| None);
        let want: Vec<Column> = Column::times().filter(|c| c.row().measured()).collect();
        assert_eq!(ch.shown, want);
        assert!(ch.zero.is_empty());
    }

    #[test]
    fn per_thread_counters_are_the_rows_with_a_kernel_slot_and_bytes_print_as_bytes() {
        let cs: Vec<Column> = Column::per_thread_counts().collect();
        assert!(cs.contains(&Column::Count(Counter::MajfltSwap)) && cs.contains(&Column::Count(Counter::CtxSwitches)));
        assert!(!cs.contains(&Column::Count(Counter::PagecacheAdded)), "no per-thread slot");
        assert_eq!(Column::Count(Counter::ReadBytes).format(Some(16384.0)), "16.00 KiB");
        assert_eq!(Column::Count(Counter::Minflt).format(Some(3.0)), "3.0");
        assert_eq!(Column::Time(Component::Compute).format(None), fmt::NA);
        for c in Column::times().chain(Column::per_thread_counts()) {
            assert!(c.short().chars().count() < c.width(), "{c:?}");
        }
    }

    #[test]
    fn fit_keeps_the_leading_columns() {
        let mut ch = Chosen { shown: Column::times().take(3).collect(), zero: vec![] };
        ch.fit(17);
        assert_eq!(ch.shown.len(), 2);
    }
}
