//! The bounds of every setting that sizes memory or time: each is checked where the setting is read
//! (a flag, a sweep file's key), before anything is allocated, with a message that names the setting,
//! the bound and why it is there. Within them, what the device can hold is the memory estimate's to
//! say.

/// A bound on a count: its name for messages, its largest value and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// What is counted, for messages: "a batch", "a length in tokens".
    pub what: &'static str,
    pub min: u64,
    pub max: u64,
    pub why: &'static str,
}

/// Samples (or sequences) a step runs at once.
pub const BATCH: Limit = Limit {
    what: "a batch size",
    min: 1,
    max: 65_536,
    why: "the inputs of a larger one are made before the memory estimate can refuse them",
};

/// Requests a server's client keeps in flight (`migprof load --concurrency`, `--max-in-flight`).
pub const IN_FLIGHT: Limit = Limit {
    what: "a number of requests in flight",
    min: 1,
    max: 65_536,
    why: "each is a client thread with a connection of its own",
};

/// A sequence's tokens: `--seq-len`, `--prompt-len`, `--output-len`, and a serving job's token budgets.
pub const TOKENS: Limit = Limit {
    what: "a length in tokens",
    min: 1,
    max: 1 << 20,
    why: "no model migprof runs has more positions",
};

/// Sequences a serving job runs at once.
pub const SEQUENCES: Limit = Limit {
    what: "a count of sequences",
    min: 1,
    max: 65_536,
    why: "each is given its own state before the cache is sized",
};

/// Measured iterations of a run (`--iters`, `--min-iters`, `--warmup`).
pub const ITERATIONS: Limit = Limit {
    what: "a count of iterations",
    min: 0,
    max: 100_000_000,
    why: "each measured iteration keeps its latency in memory and in the samples table",
};

/// Tokens a KV block holds (`--kv-block-size`, a sweep's `kv_block_size`).
pub const BLOCK_SIZE: Limit = Limit {
    what: "a KV block's size in tokens",
    min: 1,
    max: workloads::BlockSize::MAX as u64,
    why: workloads::BlockSize::WHY,
};

/// A KV cache's blocks as given (`--kv-blocks`).
pub const BLOCKS: Limit = Limit {
    what: "a count of KV blocks",
    min: 1,
    max: 16_777_216,
    why: "each block's table entry is kept per sequence; the device's memory bounds it further",
};

/// Rates a search measures at most.
pub const SEARCH_STEPS: Limit = Limit {
    what: "a count of search steps",
    min: 1,
    max: 1_000,
    why: "a search halves its bracket each step: 1,000 steps resolve any rate",
};

impl Limit {
    /// `value` when it is within the bound; else a message naming `setting`, the bound and why.
    pub fn check(&self, setting: &str, value: u64) -> Result<u64, String> {
        if (self.min..=self.max).contains(&value) {
            return Ok(value);
        }
        Err(self.refusal(setting, &value.to_string()))
    }

    /// Parses `text` as a whole number within the bound, naming `setting` when it is not.
    pub fn parse(&self, setting: &str, text: &str) -> Result<u64, String> {
        match text.trim().parse::<u64>() {
            Ok(v) => self.check(setting, v),
            Err(_) => Err(self.refusal(setting, text)),
        }
    }

    fn refusal(&self, setting: &str, got: &str) -> String {
        format!(
            "{setting} `{got}`: {} is a whole number from {} to {} ({})",
            self.what, self.min, self.max, self.why
        )
    }
}

/// Seconds of one span (a warm-up, a measurement, a step, a drain).
pub const MAX_SECONDS: f64 = 86_400.0;

/// Checks a span in seconds: finite, at most a day, and above 0 (`positive`) or at least 0.
pub fn seconds(setting: &str, value: f64, positive: bool) -> Result<f64, String> {
    let why = ", as every span is bounded so that a run's longest time can be worked out";
    within_a_day(setting, value, positive, "seconds", MAX_SECONDS, why)
}

/// Checks a time in milliseconds (an objective, a batcher's delay): finite, at most a day, and
/// above 0 (`positive`) or at least 0.
pub fn milliseconds(setting: &str, value: f64, positive: bool) -> Result<f64, String> {
    within_a_day(setting, value, positive, "milliseconds", MAX_SECONDS * 1e3, "")
}

/// `value` in `unit`s, of which a day is `day`: finite, at most a day, above or from 0.
fn within_a_day(setting: &str, value: f64, positive: bool, unit: &str, day: f64, why: &str) -> Result<f64, String> {
    let low_ok = if positive { value > 0.0 } else { value >= 0.0 };
    if value.is_finite() && low_ok && value <= day {
        return Ok(value);
    }
    Err(format!(
        "{setting} `{value}`: {unit} from {} to a day ({day}){why}",
        if positive { "above 0" } else { "0" }
    ))
}

/// Requests one load or serving step offers at most (rate × seconds of arrivals): a step keeps each
/// measured request's latency, and its queue may hold them all.
pub const MAX_STEP_REQUESTS: f64 = 10_000_000.0;

/// A search step's measured requests at the fewest (`--min-requests`, a sweep's `min_requests`):
/// enough for a p99 worth deciding on, and a quarter of a step, which runs on to four times as many.
pub const MIN_REQUESTS: Limit = Limit {
    what: "a count of requests",
    min: 100,
    max: MAX_STEP_REQUESTS as u64 / 4,
    why: "fewer make a p99 not worth much, and a search step may measure four times as many",
};

/// Checks that `qps` over `duration_secs` offers at most [`MAX_STEP_REQUESTS`], naming both settings.
pub fn step_requests(rate_setting: &str, qps: f64, duration_setting: &str, duration_secs: f64) -> Result<(), String> {
    let requests = qps * duration_secs;
    if requests <= MAX_STEP_REQUESTS {
        return Ok(());
    }
    Err(format!(
        "{rate_setting} {qps} over {duration_setting} {duration_secs} s offers {requests:.3e} requests a step; a step offers at most {MAX_STEP_REQUESTS:.0} (it keeps each request's latency, and its queue may hold them all): at this duration, at most {:.0} requests/s",
        MAX_STEP_REQUESTS / duration_secs
    ))
}

// The command line's and a sweep file's readings of a setting, in the bounds above.

pub fn parse_max_batch(s: &str) -> Result<usize, String> {
    BATCH.parse("--max-batch", s).map(|b| b as usize)
}

/// `--kv-block-size`: tokens a KV block holds.
pub fn parse_block_size(s: &str) -> Result<workloads::BlockSize, String> {
    let tokens = BLOCK_SIZE.parse("--kv-block-size", s)?;
    workloads::BlockSize::new(tokens as i64)
}

/// Seconds of a span, within [`seconds`]'s bounds.
pub fn parse_seconds(flag: &str, s: &str, positive: bool) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) => seconds(flag, v, positive),
        Err(_) => Err(format!("{flag} `{s}`: expected seconds, a number such as 2.5")),
    }
}

/// Milliseconds of an objective or a delay, within [`milliseconds`]'s bounds.
pub fn parse_milliseconds(flag: &str, s: &str, positive: bool) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) => milliseconds(flag, v, positive),
        Err(_) => Err(format!("{flag} `{s}`: expected milliseconds, a number such as 50")),
    }
}

/// A precision in percent: above 0, below 100.
pub fn parse_percent(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(v) if v > 0.0 && v < 100.0 => Ok(v),
        _ => Err(format!(
            "expected a percentage above 0 and below 100 (e.g. 2 for ±2%); got `{s}`"
        )),
    }
}

/// A share above 0 and at most 1.
pub fn parse_share(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("expected a share above 0 and at most 1 (e.g. 0.8); got `{s}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bound_takes_its_ends_and_refuses_past_them_by_name() {
        assert_eq!(BATCH.parse("--batch", "1"), Ok(1));
        assert_eq!(BATCH.parse("--batch", "65536"), Ok(65_536));
        for bad in [
            "0",
            "65537",
            "4294967295",
            "18446744073709551615",
            "18446744073709551616",
            "-1",
            "x",
            "1.5",
        ] {
            let e = BATCH.parse("--batch", bad).unwrap_err();
            assert!(
                e.starts_with(&format!(
                    "--batch `{bad}`: a batch size is a whole number from 1 to 65536"
                )),
                "{e}"
            );
        }
        assert_eq!(ITERATIONS.parse("--warmup", "0"), Ok(0));
        assert!(seconds("--duration", 0.0, true).is_err());
        assert_eq!(seconds("--warmup", 0.0, false), Ok(0.0));
        assert_eq!(seconds("--duration", 86_400.0, true), Ok(86_400.0));
        for bad in [86_400.5, 1e300, f64::NAN, f64::INFINITY, -1.0] {
            assert!(seconds("--duration", bad, true).unwrap_err().contains("a day"));
        }
        assert!(milliseconds("--slo-p99-ms", 1e300, true)
            .unwrap_err()
            .contains("--slo-p99-ms"));
        assert!(step_requests("--qps", 1e6, "--duration", 10.0).is_ok());
        let e = step_requests("--qps", 1e11, "--duration", 10.0).unwrap_err();
        assert!(
            e.contains("1.000e12 requests") && e.contains("at most 1000000 requests/s"),
            "{e}"
        );
    }
}
