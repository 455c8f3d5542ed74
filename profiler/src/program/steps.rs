//! The steps a program reports, read in one of two ways.
//!
//! The step protocol: one line of JSON per step, appended to the file whose path migprof puts in
//! [`STEPS_ENV`]: `{"duration_ms": 12.5, "items": 32, "phase": "train"}`. `duration_ms` (or
//! `duration_s`) is the step's time; `items` what it processed (samples, sequences, tokens; default
//! 1); `phase` one of `warmup` (not measured), `infer`, `train` or `generate` (default: the mode
//! `migprof exec` was given). Nothing else is a key, so that a typo is an error rather than a step
//! with a default.
//!
//! A step pattern (`--step-pattern`) for a program that cannot be edited: a regular expression
//! applied to each line of its output, whose named groups give a step: `ms` or `secs` (its time) or
//! `rate` (items per second), and `items`.

use std::time::Duration;

use regex::Regex;
use serde::Deserialize;
use workloads::Mode;

/// The environment variable naming the file a program appends its step lines to.
pub const STEPS_ENV: &str = "MIGPROF_STEPS";

/// What a step was: warm-up (left out of the measurement) or a measured step of a mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Warmup,
    Measured(Mode),
}

impl Phase {
    fn parse(s: &str) -> Result<Phase, String> {
        match s {
            "warmup" => Ok(Phase::Warmup),
            _ => Mode::parse(s)
                .map(Phase::Measured)
                .map_err(|_| format!("phase `{s}`; valid phases: warmup, infer, train, generate")),
        }
    }
}

/// One step a program reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub duration: Duration,
    /// What the step processed, in the program's unit (samples, sequences, tokens).
    pub items: f64,
    pub phase: Phase,
}

/// A line as the protocol writes it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    #[serde(default)]
    duration_ms: Option<f64>,
    #[serde(default)]
    duration_s: Option<f64>,
    #[serde(default)]
    items: Option<f64>,
    #[serde(default)]
    phase: Option<String>,
}

/// The longest step taken: a day, as every span migprof reads is bounded.
const MAX_STEP_SECS: f64 = 86_400.0;

/// A step of `secs` seconds and `items` items, each checked.
fn step(secs: f64, items: f64, phase: Phase) -> Result<Step, String> {
    if !(secs.is_finite() && secs > 0.0 && secs <= MAX_STEP_SECS) {
        return Err(format!("a step's duration is above 0 and at most a day; got {secs} s"));
    }
    if !(items.fract() == 0.0 && (1.0..=crate::run::limits::BATCH.max as f64).contains(&items)) {
        return Err(format!(
            "a step's items are a whole number from 1 to {}; got {items}",
            crate::run::limits::BATCH.max
        ));
    }
    Ok(Step {
        duration: Duration::from_secs_f64(secs),
        items,
        phase,
    })
}

/// A line of the step protocol; `mode` is the phase of a line that names none. A blank line is no
/// step (`None`).
pub fn parse_line(text: &str, mode: Mode) -> Result<Option<Step>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let line: Line = serde_json::from_str(text).map_err(|e| {
        format!("not a step line ({e}); a step line is JSON such as {{\"duration_ms\": 12.5, \"items\": 32, \"phase\": \"train\"}}")
    })?;
    let secs = match (line.duration_ms, line.duration_s) {
        (Some(ms), None) => ms / 1e3,
        (None, Some(s)) => s,
        (Some(_), Some(_)) => return Err("give duration_ms or duration_s, not both".into()),
        (None, None) => return Err("no duration: give duration_ms or duration_s".into()),
    };
    let phase = match &line.phase {
        Some(p) => Phase::parse(p)?,
        None => Phase::Measured(mode),
    };
    step(secs, line.items.unwrap_or(1.0), phase).map(Some)
}

/// A `--step-pattern`: which of its named groups give a step.
#[derive(Debug, Clone)]
pub struct Pattern {
    regex: Regex,
    duration: Measure,
}

/// How a pattern gives a step's time.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Measure {
    Millis,
    Secs,
    /// Items per second: the time is the items over it.
    Rate,
}

impl std::str::FromStr for Pattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Pattern, String> {
        let regex = Regex::new(s).map_err(|e| format!("--step-pattern: not a regular expression: {e}"))?;
        let names: Vec<&str> = regex.capture_names().flatten().collect();
        let has = |n: &str| names.contains(&n);
        let given: Vec<Measure> = [
            ("ms", Measure::Millis),
            ("secs", Measure::Secs),
            ("rate", Measure::Rate),
        ]
        .into_iter()
        .filter(|(n, _)| has(n))
        .map(|(_, m)| m)
        .collect();
        let duration = match given[..] {
            [one] => one,
            [] => return Err(format!(
                "--step-pattern `{s}` names no group for the step's time: give one of (?P<ms>…), (?P<secs>…) or (?P<rate>…), and (?P<items>…) for what it processed, e.g. 'step took (?P<ms>[0-9.]+) ms'"
            )),
            _ => return Err(format!("--step-pattern `{s}`: give one of the groups ms, secs and rate, not several")),
        };
        if let Some(other) = names.iter().find(|n| !["ms", "secs", "rate", "items"].contains(n)) {
            return Err(format!(
                "--step-pattern `{s}`: group `{other}` means nothing to migprof; its groups are ms, secs, rate and items"
            ));
        }
        Ok(Pattern { regex, duration })
    }
}

impl Pattern {
    /// The regular expression as given.
    pub fn as_str(&self) -> &str {
        self.regex.as_str()
    }

    /// The step in an output line (`None`: the line is no step), of `mode`'s phase.
    pub fn step(&self, line: &str, mode: Mode) -> Result<Option<Step>, String> {
        let Some(caps) = self.regex.captures(line) else {
            return Ok(None);
        };
        let number = |name: &str| -> Result<Option<f64>, String> {
            caps.name(name)
                .map(|m| {
                    m.as_str()
                        .trim()
                        .parse::<f64>()
                        .map_err(|_| format!("group `{name}` matched `{}`, not a number", m.as_str()))
                })
                .transpose()
        };
        let items = number("items")?.unwrap_or(1.0);
        let value = match self.duration {
            Measure::Millis => number("ms")?,
            Measure::Secs => number("secs")?,
            Measure::Rate => number("rate")?,
        };
        let Some(value) = value else {
            return Ok(None);
        };
        let secs = match self.duration {
            Measure::Millis => value / 1e3,
            Measure::Secs => value,
            Measure::Rate if value > 0.0 => items / value,
            Measure::Rate => return Err(format!("a rate of {value} items per second")),
        };
        step(secs, items, Phase::Measured(mode)).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_line_reads_with_its_defaults() {
        let s = parse_line(r#"{"duration_ms": 12.5, "items": 32, "phase": "train"}"#, Mode::Infer)
            .unwrap()
            .unwrap();
        assert_eq!(s.duration, Duration::from_micros(12_500));
        assert_eq!((s.items, s.phase), (32.0, Phase::Measured(Mode::Train)));
        let s = parse_line(r#"{"duration_s": 0.5}"#, Mode::Train).unwrap().unwrap();
        assert_eq!(
            (s.duration, s.items, s.phase),
            (Duration::from_millis(500), 1.0, Phase::Measured(Mode::Train))
        );
        let w = parse_line(r#"{"duration_ms": 3, "phase": "warmup"}"#, Mode::Infer)
            .unwrap()
            .unwrap();
        assert_eq!(w.phase, Phase::Warmup);
        assert_eq!(parse_line("   ", Mode::Infer), Ok(None));
    }

    #[test]
    fn a_malformed_step_line_says_what_is_wrong() {
        let e = |t: &str| parse_line(t, Mode::Infer).unwrap_err();
        assert!(e("step 3 took 12 ms").contains("not a step line"));
        assert!(e(r#"{"duration": 12}"#).contains("unknown field"));
        assert!(e(r#"{"items": 12}"#).contains("no duration"));
        assert!(e(r#"{"duration_ms": 1, "duration_s": 1}"#).contains("not both"));
        assert!(e(r#"{"duration_ms": -1}"#).contains("above 0"));
        assert!(e(r#"{"duration_ms": 1, "items": 0}"#).contains("items"));
        assert!(e(r#"{"duration_ms": 1, "items": 0.5}"#).contains("whole number"));
        assert!(e(r#"{"duration_ms": 1, "items": 1e300}"#).contains("whole number"));
        assert!(e(r#"{"duration_ms": 1, "phase": "eval"}"#).contains("warmup, infer, train, generate"));
    }

    #[test]
    fn a_pattern_reads_a_time_or_a_rate_and_the_items() {
        let p: Pattern = r"iter \d+: (?P<ms>[0-9.]+) ms, batch (?P<items>\d+)".parse().unwrap();
        let s = p.step("iter 7: 40 ms, batch 8", Mode::Train).unwrap().unwrap();
        assert_eq!(
            (s.duration, s.items, s.phase),
            (Duration::from_millis(40), 8.0, Phase::Measured(Mode::Train))
        );
        assert_eq!(p.step("loading weights", Mode::Infer).unwrap(), None);
        let rate: Pattern = r"(?P<rate>[0-9.]+) samples/s \(batch (?P<items>\d+)\)".parse().unwrap();
        let s = rate
            .step("speed: 400 samples/s (batch 8)", Mode::Infer)
            .unwrap()
            .unwrap();
        assert_eq!(s.duration, Duration::from_millis(20));
        let secs: Pattern = r"took (?P<secs>\S+) s".parse().unwrap();
        assert!(secs
            .step("took fast s", Mode::Infer)
            .unwrap_err()
            .contains("not a number"));
    }

    #[test]
    fn a_pattern_without_a_time_or_with_stray_groups_is_refused() {
        let e = |s: &str| s.parse::<Pattern>().unwrap_err();
        assert!(e(r"batch (?P<items>\d+)").contains("(?P<ms>"));
        assert!(e(r"(?P<ms>\d+) (?P<secs>\d+)").contains("not several"));
        assert!(e(r"(?P<ms>\d+) (?P<loss>\d+)").contains("`loss`"));
        assert!(e(r"(?P<ms>\d+").contains("not a regular expression"));
    }
}
