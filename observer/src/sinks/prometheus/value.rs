//! Metric values that know whether they were ever measured.
//!
//! `prometheus-client`'s own `Counter`/`Gauge` always print (0 by default);
//! here "not measured" must print nothing (an empty metric has no series and
//! no descriptor), never 0. Inside a `Family`, a label set only exists once a
//! value for it was measured, so the flag is set on creation's first use.

use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU64, Ordering},
};

use prometheus_client::{
    encoding::{EncodeMetric, MetricEncoder, NoLabelSet},
    metrics::{MetricType, TypedMetric},
};

#[derive(Debug, Default)]
struct Slot {
    v: AtomicU64,
    measured: AtomicBool,
}

/// A counter of nanoseconds, exported in seconds. Integer accumulation keeps
/// long runs exact; the conversion happens only when encoding.
#[derive(Debug, Default, Clone)]
pub struct Seconds(Arc<Slot>);

impl Seconds {
    pub fn add_ns(&self, ns: u64) {
        self.0.v.fetch_add(ns, Ordering::Relaxed);
        self.0.measured.store(true, Ordering::Relaxed);
    }
    pub fn ns(&self) -> u64 {
        self.0.v.load(Ordering::Relaxed)
    }
}

impl TypedMetric for Seconds {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for Seconds {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&(self.ns() as f64 / 1e9), None)
    }
    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
    fn is_empty(&self) -> bool {
        !self.0.measured.load(Ordering::Relaxed)
    }
}

/// A counter of events that may be unmeasured (e.g. BPF run counts when the
/// kernel's BPF statistics are off).
#[derive(Debug, Default, Clone)]
pub struct Count(Arc<Slot>);

impl Count {
    pub fn add(&self, n: u64) {
        self.0.v.fetch_add(n, Ordering::Relaxed);
        self.0.measured.store(true, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.v.load(Ordering::Relaxed)
    }
}

impl TypedMetric for Count {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for Count {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }
    fn metric_type(&self) -> MetricType {
        MetricType::Counter
    }
    fn is_empty(&self) -> bool {
        !self.0.measured.load(Ordering::Relaxed)
    }
}

/// A gauge that is absent while not measured (`set(None)` removes it again,
/// e.g. the target's memory once the target is gone).
#[derive(Debug, Default, Clone)]
pub struct Level(Arc<Slot>);

impl Level {
    pub fn set(&self, v: Option<f64>) {
        match v {
            Some(v) if v.is_finite() => {
                self.0.v.store(v.to_bits(), Ordering::Relaxed);
                self.0.measured.store(true, Ordering::Relaxed);
            }
            _ => self.0.measured.store(false, Ordering::Relaxed),
        }
    }
    pub fn get(&self) -> Option<f64> {
        self.0.measured.load(Ordering::Relaxed).then(|| f64::from_bits(self.0.v.load(Ordering::Relaxed)))
    }
}

impl TypedMetric for Level {
    const TYPE: MetricType = MetricType::Gauge;
}

impl EncodeMetric for Level {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        encoder.encode_gauge(&f64::from_bits(self.0.v.load(Ordering::Relaxed)))
    }
    fn metric_type(&self) -> MetricType {
        MetricType::Gauge
    }
    fn is_empty(&self) -> bool {
        !self.0.measured.load(Ordering::Relaxed)
    }
}
