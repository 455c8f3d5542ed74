//! The fewest GPUs, each cut into one valid MIG layout (or left whole), whose instances serve every
//! model's demand: an integer program solved exactly (good_lp over the pure-Rust microlp), in three
//! stages for the three goals in order — GPUs, then instances that serve nothing, then distinct
//! layouts.
//!
//! Variables: `y_l` GPUs with layout `l`; `x_mp` instances of profile `p` serving model `m` (only
//! where `m` has a capacity on `p`). Constraints: per profile, the instances assigned are at most
//! those the layouts hold; per model, the capacities of its instances (after headroom) cover its
//! demand. An instance of a profile no model has a capacity for serves nothing: it is unused.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{anyhow, bail, Result};
use good_lp::{constraint, microlp, variable, Expression, ProblemVariables, Solution, SolverModel, Variable};

/// What one GPU is cut into.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Layout {
    /// GPU-instance profiles, largest first; `["full"]` with MIG off.
    pub profiles: Vec<String>,
}

/// The profile name of a GPU with MIG off, served whole.
pub const FULL: &str = "full";

impl Layout {
    pub fn mig_enabled(&self) -> bool {
        self.profiles != [FULL]
    }

    fn count(&self, profile: &str) -> u32 {
        self.profiles.iter().filter(|p| *p == profile).count() as u32
    }

    /// `3g.40gb + 4 × 1g.10gb`, or MIG off.
    pub fn describe(&self) -> String {
        if !self.mig_enabled() {
            return "MIG off (whole GPU)".into();
        }
        let mut parts: Vec<(String, usize)> = Vec::new();
        for p in &self.profiles {
            match parts.last_mut() {
                Some((last, n)) if last == p => *n += 1,
                _ => parts.push((p.clone(), 1)),
            }
        }
        parts
            .iter()
            .map(|(p, n)| if *n == 1 { p.clone() } else { format!("{n} × {p}") })
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

/// The planning problem: demands in requests/s, and each model's usable rate per instance of a
/// profile (its capacity times the headroom).
#[derive(Debug, Clone)]
pub struct Problem {
    pub layouts: Vec<Layout>,
    pub demand: Vec<(String, f64)>,
    pub usable: BTreeMap<(String, String), f64>,
}

/// A solution.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetPlan {
    pub gpus: u32,
    /// Each distinct layout and how many GPUs use it.
    pub layouts: Vec<(Layout, u32)>,
    /// (model, profile, instances).
    pub instances: Vec<(String, String, u32)>,
    /// Instances that serve no model.
    pub unused: u32,
}

impl FleetPlan {
    /// Requests/s each model's instances can serve within headroom, less its demand.
    pub fn spare(&self, problem: &Problem) -> Vec<(String, f64)> {
        problem
            .demand
            .iter()
            .map(|(m, d)| {
                let served: f64 = self
                    .instances
                    .iter()
                    .filter(|(im, _, _)| im == m)
                    .map(|(_, p, n)| problem.usable[&(m.clone(), p.clone())] * *n as f64)
                    .sum();
                (m.clone(), served - d)
            })
            .collect()
    }
}

impl Problem {
    fn profiles(&self) -> BTreeSet<String> {
        self.layouts.iter().flat_map(|l| l.profiles.iter().cloned()).collect()
    }

    /// An upper bound on GPUs per layout: every model on its best single instance type, each on GPUs
    /// of its own.
    fn bound(&self) -> Result<u32> {
        let mut total = 0f64;
        for (m, d) in &self.demand {
            let best = self
                .layouts
                .iter()
                .map(|l| {
                    l.profiles
                        .iter()
                        .map(|p| self.usable.get(&(m.clone(), p.clone())).copied().unwrap_or(0.0))
                        .sum::<f64>()
                })
                .fold(0.0, f64::max);
            if best <= 0.0 {
                bail!("no capacity for {m} on any profile of the layouts: nothing can serve it");
            }
            total += (d / best).ceil();
        }
        // Each model's GPUs are at least its demand over the best a GPU of any layout serves of it,
        // so a bound this far beyond the largest plan is a demand off by a factor, not a fleet.
        if total > MAX_PLAN_GPUS as f64 + self.demand.len() as f64 {
            bail!(
                "the demands need about {total:.3e} GPUs (each model's requests/s over the most a GPU serves of it); a plan is at most {MAX_PLAN_GPUS} GPUs: is a demand off by a factor?"
            );
        }
        Ok((total as u32).max(1))
    }
}

/// The most GPUs a plan may take: beyond it the integer program's numbers outgrow its precision.
pub const MAX_PLAN_GPUS: u32 = 1_000_000;

pub fn solve(problem: &Problem) -> Result<FleetPlan> {
    let bound = problem.bound()?;
    // Stage 1: the fewest GPUs.
    let gpus = stage(problem, bound, Goal::Gpus, None, None)?.gpus;
    // Stage 2: at that count, the fewest instances serving nothing.
    let unused = stage(problem, bound, Goal::Unused, Some(gpus), None)?.unused;
    // Stage 3: at both, the fewest distinct layouts.
    stage(problem, bound, Goal::Distinct, Some(gpus), Some(unused))
}

#[derive(Clone, Copy, PartialEq)]
enum Goal {
    Gpus,
    Unused,
    Distinct,
}

fn stage(problem: &Problem, bound: u32, goal: Goal, gpus: Option<u32>, unused: Option<u32>) -> Result<FleetPlan> {
    let mut vars = ProblemVariables::new();
    let y: Vec<Variable> = problem
        .layouts
        .iter()
        .map(|_| vars.add(variable().integer().min(0).max(bound)))
        .collect();
    let z: Vec<Variable> = problem.layouts.iter().map(|_| vars.add(variable().binary())).collect();
    let profiles = problem.profiles();
    let mut x: BTreeMap<(String, String), Variable> = BTreeMap::new();
    for (m, _) in &problem.demand {
        for p in &profiles {
            if problem.usable.get(&(m.clone(), p.clone())).is_some_and(|&c| c > 0.0) {
                x.insert(
                    (m.clone(), p.clone()),
                    vars.add(variable().integer().min(0).max(bound * 7)),
                );
            }
        }
    }
    let total_gpus: Expression = y.iter().copied().sum();
    let held = |p: &str| -> Expression {
        problem
            .layouts
            .iter()
            .zip(&y)
            .map(|(l, &v)| l.count(p) as f64 * v)
            .sum()
    };
    let assigned = |p: &str| -> Expression {
        x.iter()
            .filter(|((_, xp), _)| xp == p)
            .map(|(_, &v)| Expression::from(v))
            .sum()
    };
    let unused_expr: Expression = profiles.iter().map(|p| held(p) - assigned(p)).sum();
    let distinct: Expression = z.iter().copied().sum();
    let objective = match goal {
        Goal::Gpus => total_gpus.clone(),
        Goal::Unused => unused_expr.clone(),
        Goal::Distinct => distinct,
    };
    let mut model = vars.minimise(objective).using(microlp);
    for p in &profiles {
        model = model.with(constraint!(assigned(p) <= held(p)));
    }
    // Each demand in units of itself (served / demand ≥ 1): demands of 10⁻³ and 10⁹ requests/s
    // then give the solver coefficients of one scale, where raw they made its matrix singular.
    for (m, d) in &problem.demand {
        let served: Expression = x
            .iter()
            .filter(|((xm, _), _)| xm == m)
            .map(|((xm, xp), &v)| problem.usable[&(xm.clone(), xp.clone())] / d * v)
            .sum();
        model = model.with(constraint!(served >= 1.0));
    }
    for (&yl, &zl) in y.iter().zip(&z) {
        model = model.with(constraint!(yl <= bound as f64 * zl));
    }
    if let Some(g) = gpus {
        model = model.with(constraint!(total_gpus <= g as f64));
    }
    if let Some(u) = unused {
        model = model.with(constraint!(unused_expr <= u as f64));
    }
    let solution = model
        .solve()
        .map_err(|e| anyhow!("the integer program found no plan: {e}"))?;
    Ok(read_plan(problem, &y, &x, |v| solution.value(v)))
}

/// The plan a solution gives: the layouts used and how many GPUs of each, the instances of each
/// model and profile, and the instances held that serve nothing.
fn read_plan(
    problem: &Problem,
    y: &[Variable],
    x: &BTreeMap<(String, String), Variable>,
    value: impl Fn(Variable) -> f64,
) -> FleetPlan {
    let round = |v: Variable| value(v).round().max(0.0) as u32;
    let mut layouts: Vec<(Layout, u32)> = problem
        .layouts
        .iter()
        .zip(y)
        .map(|(l, &v)| (l.clone(), round(v)))
        .filter(|(_, n)| *n > 0)
        .collect();
    layouts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let instances: Vec<(String, String, u32)> = x
        .iter()
        .map(|((m, p), &v)| (m.clone(), p.clone(), round(v)))
        .filter(|(_, _, n)| *n > 0)
        .collect();
    let gpus = layouts.iter().map(|(_, n)| n).sum();
    let held_total: u32 = layouts.iter().map(|(l, n)| l.profiles.len() as u32 * n).sum();
    let assigned_total: u32 = instances.iter().map(|(_, _, n)| n).sum();
    FleetPlan {
        gpus,
        layouts,
        instances,
        unused: held_total.saturating_sub(assigned_total),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::profile::{table, ProfileTable, GPUS};

    fn layouts(t: &ProfileTable) -> Vec<Layout> {
        crate::mig::plan::maximal_layouts(t)
            .into_iter()
            .map(|profiles| Layout { profiles })
            .collect()
    }

    /// Every multiset of `g` layouts, by indices ascending.
    fn multisets(n: usize, g: usize, from: usize, current: &mut Vec<usize>, out: &mut dyn FnMut(&[usize])) {
        if current.len() == g {
            out(current);
            return;
        }
        for i in from..n {
            current.push(i);
            multisets(n, g, i, current, out);
            current.pop();
        }
    }

    /// The best (unused, distinct layouts) over every assignment of the instances of `counts` to at
    /// most two models that meets the demand, or `None`.
    fn best_assignment(problem: &Problem, counts: &BTreeMap<String, u32>) -> Option<u32> {
        let cap = |m: usize, p: &str| {
            problem
                .demand
                .get(m)
                .and_then(|(name, _)| problem.usable.get(&(name.clone(), p.to_string())).copied())
                .unwrap_or(0.0)
        };
        let profiles: Vec<(&String, u32)> = counts.iter().map(|(p, &c)| (p, c)).collect();
        let mut best: Option<u32> = None;
        // k[i]: instances of profile i for the first model; the rest to the second where it can use
        // them, else unused.
        let mut k = vec![0u32; profiles.len()];
        loop {
            let (mut s1, mut s2, mut unused) = (0.0, 0.0, 0u32);
            let mut valid = true;
            for (i, (p, c)) in profiles.iter().enumerate() {
                let (c1, c2) = (cap(0, p), cap(1, p));
                if k[i] > 0 && c1 <= 0.0 {
                    valid = false;
                }
                s1 += k[i] as f64 * c1;
                let rest = c - k[i];
                if c2 > 0.0 {
                    s2 += rest as f64 * c2
                } else {
                    unused += rest
                }
            }
            let meets = s1 >= problem.demand[0].1 - 1e-9 && problem.demand.get(1).is_none_or(|(_, d)| s2 >= d - 1e-9);
            if valid && meets {
                best = Some(best.map_or(unused, |b| b.min(unused)));
            }
            // Next k (an odometer over 0..=c per profile).
            let mut i = 0;
            loop {
                if i == k.len() {
                    return best;
                }
                if k[i] < profiles[i].1 {
                    k[i] += 1;
                    break;
                }
                k[i] = 0;
                i += 1;
            }
        }
    }

    /// The best (gpus, unused, distinct) by trying every multiset of layouts, fewest GPUs first.
    fn brute_force(problem: &Problem, max_gpus: usize) -> Option<(u32, u32, u32)> {
        for g in 1..=max_gpus {
            let mut best: Option<(u32, u32)> = None;
            multisets(problem.layouts.len(), g, 0, &mut Vec::new(), &mut |set| {
                let mut counts = BTreeMap::new();
                for &i in set {
                    for p in &problem.layouts[i].profiles {
                        *counts.entry(p.clone()).or_insert(0u32) += 1;
                    }
                }
                if let Some(unused) = best_assignment(problem, &counts) {
                    let distinct = set.iter().collect::<BTreeSet<_>>().len() as u32;
                    if best.is_none_or(|b| (unused, distinct) < b) {
                        best = Some((unused, distinct));
                    }
                }
            });
            if let Some((u, d)) = best {
                return Some((g as u32, u, d));
            }
        }
        None
    }

    /// A plan is valid: layouts from the problem, instances within them, every demand met.
    fn check_valid(problem: &Problem, plan: &FleetPlan) {
        for (l, _) in &plan.layouts {
            assert!(problem.layouts.contains(l), "{l:?}");
        }
        for (p, held) in plan
            .layouts
            .iter()
            .flat_map(|(l, n)| l.profiles.iter().map(move |p| (p, *n)))
            .fold(BTreeMap::new(), |mut acc, (p, n)| {
                *acc.entry(p.clone()).or_insert(0) += n;
                acc
            })
        {
            let assigned: u32 = plan
                .instances
                .iter()
                .filter(|(_, ip, _)| *ip == p)
                .map(|(_, _, n)| n)
                .sum();
            assert!(assigned <= held, "{p}: {assigned} > {held}");
        }
        for (m, spare) in plan.spare(problem) {
            assert!(spare >= -1e-6, "{m} short by {}", -spare);
        }
    }

    /// Capacities that favour small slices for `small` (sublinear in compute) and large ones for
    /// `large` (superlinear), so that mixed layouts win.
    fn usable(t: &ProfileTable, models: &[(&str, f64)]) -> BTreeMap<(String, String), f64> {
        let mut u = BTreeMap::new();
        for p in &t.profiles {
            // Media-extension variants are left without a capacity: they must come out unused.
            if p.name.contains("+me") {
                continue;
            }
            for (m, exponent) in models {
                u.insert(
                    (m.to_string(), p.name.clone()),
                    100.0 * (p.compute_slices as f64).powf(*exponent),
                );
            }
        }
        u
    }

    #[test]
    fn the_integer_program_matches_brute_force_on_every_gpu_table() -> Result<()> {
        for (gpu, _) in GPUS {
            let t = table(gpu)?;
            let all = layouts(&t);
            // (models with their exponents, demands)
            type Case<'a> = (Vec<(&'a str, f64)>, Vec<f64>);
            let cases: Vec<Case> = vec![
                (vec![("small", 0.7)], vec![150.0, 500.0, 1100.0]),
                (vec![("large", 1.3)], vec![900.0]),
                (vec![("small", 0.7), ("large", 1.3)], vec![300.0, 700.0]),
                (vec![("small", 0.7), ("large", 1.3)], vec![450.0, 250.0]),
                (vec![("small", 0.6), ("large", 1.5)], vec![640.0, 1200.0]),
            ];
            for (models, demands) in cases {
                let problem = Problem {
                    layouts: all.clone(),
                    demand: models
                        .iter()
                        .zip(&demands)
                        .map(|((m, _), d)| (m.to_string(), *d))
                        .collect(),
                    usable: usable(&t, &models),
                };
                let plan = solve(&problem)?;
                check_valid(&problem, &plan);
                let distinct = plan.layouts.len() as u32;
                let want = brute_force(&problem, 4).expect("the cases fit four GPUs");
                assert_eq!(
                    (plan.gpus, plan.unused, distinct),
                    want,
                    "{gpu} {models:?} {demands:?}: {plan:?}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn a_mixed_layout_beats_homogeneous_ones_when_models_prefer_different_slices() -> Result<()> {
        let t = table("h100-80gb")?;
        // small: 100 per 1g; large: 100·4^1.5 = 800 on a 4g, 519.6 on a 3g. 300 + 520 fit one GPU as
        // a 4g for large beside three 1g for small, and no homogeneous layout does.
        let problem = Problem {
            layouts: layouts(&t),
            demand: vec![("small".into(), 300.0), ("large".into(), 520.0)],
            usable: usable(&t, &[("small", 0.6), ("large", 1.5)]),
        };
        let plan = solve(&problem)?;
        check_valid(&problem, &plan);
        assert_eq!(plan.gpus, 1, "{plan:?}");
        let kinds: BTreeSet<&String> = plan.layouts[0].0.profiles.iter().collect();
        assert!(kinds.len() > 1, "a mixed layout: {plan:?}");
        assert_eq!(
            plan.unused, 0,
            "not a layout with a 1g.10gb+me that nothing serves: {plan:?}"
        );
        // No layout of one profile serves both on one GPU: the hand plan of one profile per model
        // needs two.
        let homogeneous: Vec<Layout> = layouts(&t)
            .into_iter()
            .filter(|l| l.profiles.iter().collect::<BTreeSet<_>>().len() == 1)
            .collect();
        let only_homogeneous = Problem {
            layouts: homogeneous,
            ..problem.clone()
        };
        assert_eq!(solve(&only_homogeneous)?.gpus, 2);
        Ok(())
    }

    #[test]
    fn demands_far_apart_in_scale_plan_and_an_absurd_one_is_refused_in_words() -> Result<()> {
        let t = table("h100-80gb")?;
        let usable = usable(&t, &[("small", 0.6), ("large", 1.5)]);
        let problem = Problem {
            layouts: layouts(&t),
            demand: vec![("small".into(), 1e-3), ("large".into(), 20_000.0)],
            usable: usable.clone(),
        };
        let plan = solve(&problem)?;
        check_valid(&problem, &plan);
        assert!(
            plan.instances.iter().any(|(m, _, n)| m == "small" && *n >= 1),
            "{plan:?}"
        );
        let absurd = Problem {
            demand: vec![("small".into(), 1e15)],
            ..problem
        };
        let e = solve(&absurd).unwrap_err().to_string();
        assert!(
            e.contains("is a demand off by a factor?") && e.contains("1000000 GPUs"),
            "{e}"
        );
        Ok(())
    }

    #[test]
    fn a_model_no_profile_can_serve_is_an_error_naming_it() {
        let t = table("a30-24gb").unwrap();
        let problem = Problem {
            layouts: layouts(&t),
            demand: vec![("bert".into(), 10.0)],
            usable: BTreeMap::new(),
        };
        let e = solve(&problem).unwrap_err().to_string();
        assert!(e.contains("no capacity for bert"), "{e}");
    }
}
