//! How long a language model's requests are: each request's prompt and output lengths in tokens,
//! drawn from a stated distribution with a seed, so that the work a load step offers is fixed in
//! advance as its arrivals are.

use std::fmt;
use std::str::FromStr;

use rand::{Rng, SeedableRng};

/// A distribution of token counts, as `--prompt-len` and `--output-len` name it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LengthDist {
    /// Every request the same.
    Fixed(u32),
    /// Uniform over `min..=max`.
    Uniform { min: u32, max: u32 },
    /// Lognormal with this mean (in tokens) and `spread`, the standard deviation of the length's
    /// logarithm (0.5: about two thirds of requests within a factor of 1.65 of the median), rounded
    /// to the nearest whole token and at least 1: the long right tail of real prompts and answers.
    Lognormal { mean: f64, spread: f64 },
}

/// The forms a length takes, for errors.
pub const FORMS: &str =
    "N (fixed), uniform:MIN-MAX, or lognormal:MEAN,SPREAD (SPREAD the standard deviation of the log, 0 to 3)";

impl LengthDist {
    /// The distribution's mean in tokens (before rounding, for the lognormal).
    pub fn mean(&self) -> f64 {
        match *self {
            LengthDist::Fixed(n) => n as f64,
            LengthDist::Uniform { min, max } => (min as f64 + max as f64) / 2.0,
            LengthDist::Lognormal { mean, .. } => mean,
        }
    }

    /// The most tokens a draw can be: the longest a request of it can need (a lognormal's is
    /// unbounded).
    pub fn max(&self) -> Option<u32> {
        match *self {
            LengthDist::Fixed(n) => Some(n),
            LengthDist::Uniform { max, .. } => Some(max),
            LengthDist::Lognormal { .. } => None,
        }
    }

    /// Draws lengths with `seed`: the same seed, the same lengths.
    pub fn sampler(&self, seed: u64) -> LengthSampler {
        LengthSampler {
            dist: *self,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }
}

impl fmt::Display for LengthDist {
    /// The form it was given in, canonical: what a row records.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LengthDist::Fixed(n) => write!(f, "{n}"),
            LengthDist::Uniform { min, max } => write!(f, "uniform:{min}-{max}"),
            LengthDist::Lognormal { mean, spread } => write!(f, "lognormal:{mean},{spread}"),
        }
    }
}

impl FromStr for LengthDist {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("length `{s}`: {why}; a length is {FORMS}");
        // No model migprof serves has more positions than a length may have.
        let most = crate::run::limits::TOKENS.max;
        let tokens = |v: &str| -> Result<u32, String> {
            match v.trim().parse::<u64>() {
                Ok(n) if n > 0 && n <= most => Ok(n as u32),
                _ => Err(bad(&format!("`{v}` is not a whole number of tokens from 1 to {most}"))),
            }
        };
        if let Some((kind, _)) = s
            .split_once(':')
            .filter(|(k, _)| !matches!(*k, "uniform" | "lognormal"))
        {
            return Err(bad(&format!("`{kind}` is no distribution migprof draws")));
        }
        if let Some(range) = s.strip_prefix("uniform:") {
            let (lo, hi) = range.split_once('-').ok_or_else(|| bad("a range is MIN-MAX"))?;
            let (min, max) = (tokens(lo)?, tokens(hi)?);
            if min > max {
                return Err(bad("MIN is above MAX"));
            }
            return Ok(LengthDist::Uniform { min, max });
        }
        if let Some(params) = s.strip_prefix("lognormal:") {
            let (m, sd) = params
                .split_once(',')
                .ok_or_else(|| bad("a lognormal is MEAN,SPREAD"))?;
            let number = |v: &str| v.trim().parse::<f64>().ok().filter(|x| x.is_finite());
            let mean = number(m)
                .filter(|&x| (1.0..=most as f64).contains(&x))
                .ok_or_else(|| bad(&format!("MEAN is a number of tokens from 1 to {most}")))?;
            let spread = number(sd)
                .filter(|x| (0.0..=3.0).contains(x))
                .ok_or_else(|| bad("SPREAD is a number from 0 to 3"))?;
            return Ok(LengthDist::Lognormal { mean, spread });
        }
        tokens(s).map(LengthDist::Fixed)
    }
}

/// Lengths drawn one at a time from a [`LengthDist`].
pub struct LengthSampler {
    dist: LengthDist,
    rng: rand::rngs::StdRng,
}

impl LengthSampler {
    pub fn draw(&mut self) -> u32 {
        match self.dist {
            LengthDist::Fixed(n) => n,
            LengthDist::Uniform { min, max } => self.rng.random_range(min..=max),
            LengthDist::Lognormal { mean, spread } => {
                // The log's mean that makes the length's mean `mean`.
                let mu = mean.ln() - spread * spread / 2.0;
                let x = (mu + spread * self.standard_normal()).exp();
                x.round().clamp(1.0, u32::MAX as f64) as u32
            }
        }
    }

    /// A standard normal draw (Box and Muller's transform of two uniform draws).
    fn standard_normal(&mut self) -> f64 {
        // 1 - U lies in (0, 1]: its logarithm is finite.
        let u: f64 = 1.0 - self.rng.random::<f64>();
        let v: f64 = self.rng.random();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The standard normal's distribution function, from erf by Abramowitz and Stegun's 7.1.26
    /// (within 1.5e-7).
    fn phi(z: f64) -> f64 {
        let x = z.abs() / std::f64::consts::SQRT_2;
        let t = 1.0 / (1.0 + 0.327_591_1 * x);
        let poly =
            t * (0.254_829_592 + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
        let erf = 1.0 - poly * (-x * x).exp();
        if z >= 0.0 {
            (1.0 + erf) / 2.0
        } else {
            (1.0 - erf) / 2.0
        }
    }

    /// Kolmogorov and Smirnov's statistic of `draws` against the distribution function `cdf` at each
    /// whole number: the largest gap between the draws' share at or below k and cdf(k).
    fn ks(draws: &[u32], cdf: impl Fn(f64) -> f64) -> f64 {
        let mut sorted = draws.to_vec();
        sorted.sort_unstable();
        let n = sorted.len() as f64;
        let mut worst = 0f64;
        let mut i = 0;
        while i < sorted.len() {
            let (k, start) = (sorted[i], i);
            while i < sorted.len() && sorted[i] == k {
                i += 1;
            }
            // The draws' share below k and at or below it, against the function's: between two
            // drawn values the share is flat, and the next value's "below" covers the gap.
            let (before, at) = (start as f64 / n, i as f64 / n);
            worst = worst
                .max((at - cdf(k as f64)).abs())
                .max((before - cdf(k as f64 - 1.0)).abs());
        }
        worst
    }

    /// The statistic's critical value at the 1 % level for n draws (large n).
    fn critical(n: usize) -> f64 {
        1.628 / (n as f64).sqrt()
    }

    #[test]
    fn lengths_parse_in_every_form_and_print_as_given() {
        for (text, dist) in [
            ("512", LengthDist::Fixed(512)),
            ("uniform:256-768", LengthDist::Uniform { min: 256, max: 768 }),
            (
                "lognormal:512,0.5",
                LengthDist::Lognormal {
                    mean: 512.0,
                    spread: 0.5,
                },
            ),
        ] {
            assert_eq!(text.parse::<LengthDist>(), Ok(dist));
            assert_eq!(dist.to_string(), text);
        }
        for bad in [
            "0",
            "-3",
            "uniform:9-3",
            "uniform:5",
            "lognormal:512",
            "lognormal:0.5,0.5",
            "lognormal:512,4",
            "lognormal:1e300,0.5",
            "2000000",
            "uniform:1-4294967296",
            "gamma:2",
        ] {
            let e = bad.parse::<LengthDist>().unwrap_err();
            assert!(e.contains(FORMS) && e.contains(bad), "{bad}: {e}");
        }
        let e = "normal:64,5".parse::<LengthDist>().unwrap_err();
        assert!(e.contains("`normal` is no distribution migprof draws"), "{e}");
    }

    #[test]
    fn draws_follow_their_distribution_and_the_seed() {
        let n = 4000;
        let draw = |d: LengthDist, seed| {
            let mut s = d.sampler(seed);
            (0..n).map(|_| s.draw()).collect::<Vec<u32>>()
        };
        assert!(draw(LengthDist::Fixed(7), 1).iter().all(|&x| x == 7));

        let uniform = LengthDist::Uniform { min: 100, max: 400 };
        let u = draw(uniform, 3);
        assert_eq!(u, draw(uniform, 3), "the same seed, the same lengths");
        assert_ne!(u, draw(uniform, 4));
        assert!(u.iter().all(|&x| (100..=400).contains(&x)));
        let d = ks(&u, |k| ((k.floor() - 99.0) / 301.0).clamp(0.0, 1.0));
        assert!(d < critical(n), "uniform: D = {d}");

        let (mean, spread) = (512.0, 0.6);
        let l = draw(LengthDist::Lognormal { mean, spread }, 5);
        let mu = f64::ln(mean) - spread * spread / 2.0;
        // Rounded to the nearest token: at most k where the draw was below k + 0.5.
        let d = ks(&l, |k| {
            if k < 0.5 {
                0.0
            } else {
                phi(((k + 0.5).ln() - mu) / spread)
            }
        });
        assert!(d < critical(n), "lognormal: D = {d}");
        let m = l.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        // The mean's standard error is mean·sqrt(e^(σ²) − 1)/sqrt(n), about 5.8 tokens here.
        assert!((m - mean).abs() < 4.0 * 5.8, "mean {m}");

        // A distribution it was not drawn from is told apart.
        let d = ks(&l, |k| {
            if k < 0.5 {
                0.0
            } else {
                phi(((k + 0.5).ln() - mu - 0.1) / spread)
            }
        });
        assert!(d > critical(n), "a shifted lognormal passes: D = {d}");
    }
}
