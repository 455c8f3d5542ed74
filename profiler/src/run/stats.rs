//! Latency statistics of one run: exact moments from the raw samples, percentiles from an HDR
//! histogram (nanoseconds, 3 significant digits), and the two throughputs.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use hdrhistogram::serialization::{Serializer, V2DeflateSerializer};
use hdrhistogram::Histogram;

/// Significant decimal digits kept by the histogram: values are exact to 0.1%.
pub const SIGNIFICANT_DIGITS: u8 = 3;

#[derive(Debug, Clone)]
pub struct LatencyStats {
    pub iterations: u64,
    pub mean_ns: f64,
    /// Sample standard deviation; `None` for a single iteration.
    pub std_ns: Option<f64>,
    pub min_ns: u64,
    pub max_ns: u64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p95_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub histogram: Histogram<u64>,
}

impl LatencyStats {
    pub fn from_latencies(latencies_ns: &[u64]) -> Result<Self> {
        ensure!(!latencies_ns.is_empty(), "no measured iterations");
        let mut histogram = Histogram::<u64>::new(SIGNIFICANT_DIGITS)?;
        for &l in latencies_ns {
            histogram.record(l).context("recording a latency in the histogram")?;
        }
        let n = latencies_ns.len() as f64;
        let mean_ns = latencies_ns.iter().map(|&l| l as f64).sum::<f64>() / n;
        let std_ns = (latencies_ns.len() > 1).then(|| {
            let ss: f64 = latencies_ns.iter().map(|&l| (l as f64 - mean_ns).powi(2)).sum();
            (ss / (n - 1.0)).sqrt()
        });
        let min_ns = *latencies_ns.iter().min().expect("non-empty");
        let max_ns = *latencies_ns.iter().max().expect("non-empty");
        // The histogram answers with the top of a bucket; its middle halves the worst-case error, and
        // clamping to the exact extremes keeps min <= p50 <= ... <= p99.9 <= max.
        let q = |quantile: f64| {
            let v = histogram.median_equivalent(histogram.value_at_quantile(quantile));
            v.clamp(min_ns, max_ns)
        };
        Ok(Self {
            iterations: latencies_ns.len() as u64,
            mean_ns,
            std_ns,
            min_ns,
            max_ns,
            p50_ns: q(0.50),
            p90_ns: q(0.90),
            p95_ns: q(0.95),
            p99_ns: q(0.99),
            p999_ns: q(0.999),
            histogram,
        })
    }

    pub fn mean_ms(&self) -> f64 {
        self.mean_ns / 1e6
    }

    /// Samples per second as MIGProfiler and its users quote it: `1000 / mean_latency_ms * batch`.
    pub fn throughput(&self, batch: usize) -> f64 {
        1000.0 / self.mean_ms() * batch as f64
    }

    /// The histogram in HdrHistogram's V2 + DEFLATE encoding, readable by every HdrHistogram port.
    pub fn histogram_v2_deflate(&self) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        V2DeflateSerializer::new()
            .serialize(&self.histogram, &mut buf)
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        Ok(buf)
    }
}

/// Samples per second over the measured wall-clock time, harness and synchronisation included.
pub fn wall_throughput(iterations: u64, batch: usize, elapsed: Duration) -> f64 {
    (iterations * batch as u64) as f64 / elapsed.as_secs_f64()
}

pub fn ns_to_ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hdrhistogram::serialization::Deserializer;

    pub fn close(got: u64, want: u64) -> bool {
        // Within the histogram's precision: 3 significant digits.
        (got as f64 - want as f64).abs() <= want as f64 * 1e-3
    }

    #[test]
    fn alternating_one_and_three_ms() -> Result<()> {
        let lat: Vec<u64> = (0..100)
            .map(|i| if i % 2 == 0 { 1_000_000 } else { 3_000_000 })
            .collect();
        let s = LatencyStats::from_latencies(&lat)?;
        assert_eq!(s.iterations, 100);
        assert_eq!(s.mean_ns, 2_000_000.0);
        assert_eq!((s.min_ns, s.max_ns), (1_000_000, 3_000_000));
        // Half the samples are 1 ms: the median is the 1 ms bucket, every upper percentile 3 ms.
        assert!(close(s.p50_ns, 1_000_000), "p50 {}", s.p50_ns);
        for p in [s.p90_ns, s.p95_ns, s.p99_ns, s.p999_ns] {
            assert!(close(p, 3_000_000) && p <= s.max_ns, "upper percentile {p}");
        }
        // Sample std of 50 x (-1 ms) and 50 x (+1 ms): sqrt(100 / 99) ms.
        let std = s.std_ns.unwrap();
        assert!((std - 1e6 * (100.0f64 / 99.0).sqrt()).abs() < 1e-3, "{std}");
        assert_eq!(s.throughput(8), 4000.0);
        Ok(())
    }

    #[test]
    fn percentiles_of_one_to_a_thousand_microseconds() -> Result<()> {
        let lat: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        let s = LatencyStats::from_latencies(&lat)?;
        for (got, want) in [
            (s.p50_ns, 500_000),
            (s.p90_ns, 900_000),
            (s.p95_ns, 950_000),
            (s.p99_ns, 990_000),
            (s.p999_ns, 999_000),
        ] {
            assert!(close(got, want), "{got} vs {want}");
        }
        assert!(s.p50_ns <= s.p90_ns && s.p90_ns <= s.p99_ns && s.p99_ns <= s.p999_ns && s.p999_ns <= s.max_ns);
        Ok(())
    }

    #[test]
    fn one_iteration_has_no_standard_deviation() -> Result<()> {
        let s = LatencyStats::from_latencies(&[5_000])?;
        assert_eq!(s.std_ns, None);
        assert_eq!((s.p50_ns, s.p99_ns), (5_000, 5_000));
        assert!(LatencyStats::from_latencies(&[]).is_err());
        Ok(())
    }

    #[test]
    fn wall_throughput_counts_samples_over_elapsed_time() {
        assert_eq!(wall_throughput(50, 4, Duration::from_millis(400)), 500.0);
    }

    #[test]
    fn histogram_round_trips_through_v2_deflate() -> Result<()> {
        let lat: Vec<u64> = (1..=500).map(|i| i * 7919).collect();
        let s = LatencyStats::from_latencies(&lat)?;
        let bytes = s.histogram_v2_deflate()?;
        let back: Histogram<u64> = Deserializer::new().deserialize(&mut bytes.as_slice()).unwrap();
        assert_eq!(back.len(), 500);
        assert_eq!(back.value_at_quantile(0.99), s.histogram.value_at_quantile(0.99));
        Ok(())
    }
}
