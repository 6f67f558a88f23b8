//! Log2 latency histograms kept in the kernel.
//!
//! Spec: a histogram is `[u64; HIST_BUCKETS]` of counts. A value `v` (nanoseconds)
//! goes to bucket `b = ceil(log2(v))`, i.e. bucket `b` counts values in
//! `(2^(b-1), 2^b]` (bucket 0 holds `v <= 1`). Rounding *up* makes every bucket's
//! upper bound `2^b` a true `le` bound, as Prometheus histograms require. The
//! last bucket also holds everything larger (`v > 2^(HIST_BUCKETS-2)`), so it is
//! the `+Inf` bucket.

/// Number of log2 buckets: bucket 38 is 2^38 ns ≈ 275 s; bucket 39 is +Inf.
pub const HIST_BUCKETS: usize = 40;

/// Bucket index for a value, per the module spec. Written without `leading_zeros`
/// loops the verifier would have to unroll: a fixed binary search over bit widths.
#[inline(always)]
pub fn bucket_of(v: u64) -> usize {
    if v <= 1 {
        return 0;
    }
    // ceil(log2(v)) == floor(log2(v - 1)) + 1 for v >= 2.
    let mut x = v - 1;
    let mut n: usize = 1;
    if x >= 1 << 32 {
        x >>= 32;
        n += 32;
    }
    if x >= 1 << 16 {
        x >>= 16;
        n += 16;
    }
    if x >= 1 << 8 {
        x >>= 8;
        n += 8;
    }
    if x >= 1 << 4 {
        x >>= 4;
        n += 4;
    }
    if x >= 1 << 2 {
        x >>= 2;
        n += 2;
    }
    if x >= 1 << 1 {
        n += 1;
    }
    if n >= HIST_BUCKETS { HIST_BUCKETS - 1 } else { n }
}

/// Upper bound (inclusive, nanoseconds) of bucket `b`; `None` for the +Inf bucket.
pub fn bucket_upper_ns(b: usize) -> Option<u64> {
    if b + 1 >= HIST_BUCKETS { None } else { Some(1u64 << b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1), 0);
        assert_eq!(bucket_of(2), 1);
        assert_eq!(bucket_of(3), 2);
        assert_eq!(bucket_of(4), 2);
        assert_eq!(bucket_of(5), 3);
        assert_eq!(bucket_of(1024), 10);
        assert_eq!(bucket_of(1025), 11);
        assert_eq!(bucket_of(u64::MAX), HIST_BUCKETS - 1);
        for v in 2u64..5000 {
            let b = bucket_of(v);
            let hi = bucket_upper_ns(b).unwrap();
            assert!(v <= hi && v > hi / 2, "v={v} b={b}");
        }
    }
}
