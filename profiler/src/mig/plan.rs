//! The planner: whether a set of GPU instances fits a GPU, judged by the profile table's rules alone —
//! at most `max_instances` of each profile, no more compute or memory slices than the GPU has, and a
//! start for every instance among its profile's placements with no two instances sharing a memory
//! slice — and if so, where each goes and an order of creation that works.

use std::fmt::Write as _;

use anyhow::{bail, Result};

use super::profile::{MigProfile, ProfileTable};

/// Where a GPU instance sits, in memory slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GpuInstance {
    pub profile: MigProfile,
    pub placement: Placement,
}

/// A layout that fits: its GPU instances in an order that can be created one after the other
/// (largest first: a large instance has the fewest places to go).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub instances: Vec<GpuInstance>,
}

pub fn plan(table: &ProfileTable, names: &[&str]) -> Result<Plan> {
    if names.is_empty() {
        bail!("no profiles given; the {}'s: {}", table.product, profile_names(table))
    }
    let mut wanted: Vec<&MigProfile> = names.iter().map(|n| table.profile(n)).collect::<Result<_>>()?;
    for p in &table.profiles {
        let n = wanted.iter().filter(|w| w.name == p.name).count() as u32;
        if n > p.max_instances {
            bail!(
                "{n} x {} do not fit: the {} holds at most {} at once",
                p.name,
                table.product,
                p.max_instances
            )
        }
    }
    let compute: u32 = wanted.iter().map(|p| p.compute_slices).sum();
    if compute > table.compute_slices {
        bail!(
            "they need {compute} compute slices; the {} has {}",
            table.product,
            table.compute_slices
        )
    }
    let memory: u32 = wanted.iter().map(|p| p.memory_slices).sum();
    if memory > table.memory_slices {
        bail!(
            "they need {memory} memory slices; the {} has {}",
            table.product,
            table.memory_slices
        )
    }
    // Most constrained first: the largest span, then the fewest places to start.
    wanted.sort_by_key(|p| (std::cmp::Reverse(p.memory_slices), p.placements.len(), p.name.clone()));
    let mut starts = Vec::with_capacity(wanted.len());
    if !place(&wanted, 0, &mut starts) {
        let options: Vec<String> = wanted
            .iter()
            .map(|p| format!("{} at {{{}}}:{}", p.name, join(&p.placements), p.memory_slices))
            .collect();
        bail!(
            "no placement fits them without two sharing a memory slice ({})",
            options.join(", ")
        )
    }
    let instances = wanted
        .into_iter()
        .zip(starts)
        .map(|(p, start)| GpuInstance {
            profile: p.clone(),
            placement: Placement {
                start,
                size: p.memory_slices,
            },
        })
        .collect();
    Ok(Plan { instances })
}

/// Depth-first search over starts; `taken` marks the memory slices already placed.
fn place(wanted: &[&MigProfile], taken: u64, starts: &mut Vec<u32>) -> bool {
    let Some(p) = wanted.get(starts.len()) else { return true };
    for &s in &p.placements {
        let span = ((1u64 << p.memory_slices) - 1) << s;
        if taken & span == 0 {
            starts.push(s);
            if place(wanted, taken | span, starts) {
                return true;
            }
            starts.pop();
        }
    }
    false
}

/// Every layout that fits and to which no further instance can be added, each as its profile names,
/// largest first.
pub fn maximal_layouts(table: &ProfileTable) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    extend(table, 0, &mut Vec::new(), &mut out);
    out
}

/// Grows `layout` with profiles from index `from` on (so each multiset is visited once).
fn extend(table: &ProfileTable, from: usize, layout: &mut Vec<usize>, out: &mut Vec<Vec<String>>) {
    let fits = |l: &[usize]| {
        let names: Vec<&str> = l.iter().map(|&i| table.profiles[i].name.as_str()).collect();
        plan(table, &names).is_ok()
    };
    // Maximal when no profile at all (not only those from `from` on, which are grown) can join.
    let mut addable = false;
    for i in 0..table.profiles.len() {
        layout.push(i);
        if fits(layout) {
            addable = true;
            if i >= from {
                extend(table, i, layout, out);
            }
        }
        layout.pop();
    }
    if !addable && !layout.is_empty() {
        let mut names: Vec<&MigProfile> = layout.iter().map(|&i| &table.profiles[i]).collect();
        names.sort_by_key(|p| {
            (
                std::cmp::Reverse(p.compute_slices),
                std::cmp::Reverse(p.memory_slices),
                p.name.clone(),
            )
        });
        out.push(names.into_iter().map(|p| p.name.clone()).collect());
    }
}

impl Plan {
    pub fn render(&self, table: &ProfileTable) -> String {
        let mut out = format!("fits the {}: create in this order\n", table.product);
        for (i, gi) in self.instances.iter().enumerate() {
            let p = &gi.profile;
            let (start, end) = (gi.placement.start, gi.placement.start + gi.placement.size - 1);
            let slices = if start == end {
                format!("memory slice {start}")
            } else {
                format!("memory slices {start}..{end}")
            };
            let _ = writeln!(
                out,
                "  {}. {:<12} (profile id {:>2})  {slices:<18} {} SMs, {:.2} GiB",
                i + 1,
                p.name,
                p.id,
                p.sm_count,
                p.memory_gib
            );
        }
        let compute: u32 = self.instances.iter().map(|g| g.profile.compute_slices).sum();
        let memory: u32 = self.instances.iter().map(|g| g.profile.memory_slices).sum();
        let _ = writeln!(
            out,
            "  uses {compute}/{} compute slices, {memory}/{} memory slices",
            table.compute_slices, table.memory_slices
        );
        out
    }
}

fn join(v: &[u32]) -> String {
    v.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")
}

fn profile_names(table: &ProfileTable) -> String {
    table
        .profiles
        .iter()
        .map(|p| p.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::profile::{table, GPUS};

    /// Names of a layout written with the GPU's smallest profile of each size class, e.g. on the
    /// H100 "3g" is 3g.40gb.
    fn layout(t: &ProfileTable, short: &[&str]) -> Vec<String> {
        short
            .iter()
            .map(|s| {
                t.profiles
                    .iter()
                    .find(|p| p.name.starts_with(&format!("{s}.")) && !p.name.ends_with("+me"))
                    .unwrap()
                    .name
                    .clone()
            })
            .collect()
    }

    fn fits(t: &ProfileTable, short: &[&str]) -> Result<Plan> {
        let names = layout(t, short);
        plan(t, &names.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// The known layouts of a table's GPU class: seven compute slices (A100, H100, H200) or four (A30).
    fn known_layouts(t: &ProfileTable) -> (Vec<Vec<&'static str>>, Vec<Vec<&'static str>>) {
        if t.compute_slices == 7 {
            let valid = vec![
                vec!["1g"; 7],
                vec!["3g", "3g"],
                vec!["4g", "2g", "1g"],
                vec!["3g", "2g", "1g", "1g"],
                vec!["4g", "3g"],
                vec!["2g", "2g", "2g", "1g"],
                vec!["7g"],
            ];
            let invalid = vec![
                vec!["1g"; 8],
                vec!["3g"; 3],
                vec!["4g", "4g"],
                vec!["7g", "1g"],
                vec!["4g", "2g", "2g"],
            ];
            (valid, invalid)
        } else {
            let valid = vec![vec!["1g"; 4], vec!["2g", "2g"], vec!["2g", "1g", "1g"], vec!["4g"]];
            let invalid = vec![vec!["1g"; 5], vec!["2g"; 3], vec!["4g", "1g"], vec!["2g", "2g", "1g"]];
            (valid, invalid)
        }
    }

    #[test]
    fn known_valid_layouts_fit_every_table_and_known_invalid_ones_do_not() {
        for (gpu, _) in GPUS {
            let t = table(gpu).unwrap();
            let (valid, invalid) = known_layouts(&t);
            for l in valid {
                let p = fits(&t, &l).unwrap_or_else(|e| panic!("{gpu}: {l:?}: {e}"));
                assert_eq!(p.instances.len(), l.len());
            }
            for l in invalid {
                assert!(fits(&t, &l).is_err(), "{gpu}: {l:?} should not fit");
            }
        }
    }

    #[test]
    fn four_two_slice_1g_instances_on_the_a100_40gb() {
        // 1g.10gb spans two memory slices: four fill the GPU's memory, a fifth of any size cannot join.
        let t = table("a100-40gb").unwrap();
        let p = plan(&t, &["1g.10gb"; 4]).unwrap();
        let starts: Vec<u32> = p.instances.iter().map(|g| g.placement.start).collect();
        assert_eq!(starts, vec![0, 2, 4, 6]);
        assert!(plan(&t, &["1g.10gb", "1g.10gb", "1g.10gb", "1g.10gb", "1g.5gb"])
            .unwrap_err()
            .to_string()
            .contains("9 memory slices"));
    }

    #[test]
    fn a30_media_extension_profiles() {
        let t = table("a30-24gb").unwrap();
        assert!(plan(&t, &["2g.12gb+me", "2g.12gb"]).is_ok());
        assert!(plan(&t, &["2g.12gb+me", "2g.12gb+me"])
            .unwrap_err()
            .to_string()
            .contains("at most 1"));
        assert!(plan(&t, &["4g.24gb", "1g.6gb"])
            .unwrap_err()
            .to_string()
            .contains("5 compute slices"));
    }

    #[test]
    fn known_invalid_layouts_are_refused_with_the_rule_they_break() {
        let t = table("h100-80gb").unwrap();
        let why = |l: &[&str]| fits(&t, l).unwrap_err().to_string();
        assert!(why(&["1g"; 8]).contains("at most 7"), "{}", why(&["1g"; 8]));
        assert!(why(&["3g"; 3]).contains("at most 2"), "{}", why(&["3g"; 3]));
        assert!(why(&["4g", "4g"]).contains("at most 1"));
        assert!(why(&["7g", "1g"]).contains("8 compute slices"));
        assert!(why(&["4g", "2g", "2g"]).contains("8 compute slices"));
        // Memory, not compute, runs out: 1g.20gb spans two memory slices.
        let e = plan(&t, &["1g.20gb", "1g.20gb", "1g.20gb", "1g.20gb", "1g.10gb"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("9 memory slices"), "{e}");
        assert!(plan(&t, &["2g.10gb"])
            .unwrap_err()
            .to_string()
            .contains("its profiles: 1g.10gb"));
    }

    #[test]
    fn colliding_placements_are_judged_by_the_rule() {
        // On the real tables every layout within the counts and slices finds room; a table whose
        // 2g profile may start at slice 0 only shows the placement rule on its own.
        let mut t = table("h100-80gb").unwrap();
        t.profiles.iter_mut().find(|p| p.name == "2g.20gb").unwrap().placements = vec![0];
        let e = plan(&t, &["2g.20gb", "2g.20gb"]).unwrap_err().to_string();
        assert!(e.contains("no placement fits") && e.contains("2g.20gb at {0}:2"), "{e}");
        assert!(plan(&t, &["2g.20gb", "1g.10gb", "1g.10gb"]).is_ok());
    }

    #[test]
    fn placements_and_creation_order() {
        let t = table("h100-80gb").unwrap();
        let p = plan(&t, &["1g.10gb", "2g.20gb", "3g.40gb", "1g.10gb"]).unwrap();
        let got: Vec<(&str, u32)> = p
            .instances
            .iter()
            .map(|g| (g.profile.name.as_str(), g.placement.start))
            .collect();
        // 3g first; at 0 it would leave slice 7, where no 1g may start, so the search moves it to 4.
        assert_eq!(
            got,
            vec![("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)]
        );
        let text = p.render(&t);
        assert!(
            text.contains("1. 3g.40gb      (profile id  9)  memory slices 4..7 "),
            "{text}"
        );
        assert!(
            text.contains("3. 1g.10gb      (profile id 19)  memory slice 2 "),
            "{text}"
        );
        assert!(text.contains("uses 7/7 compute slices, 8/8 memory slices"), "{text}");
    }

    #[test]
    fn only_one_media_extension_instance() {
        let t = table("h100-80gb").unwrap();
        assert!(plan(&t, &["1g.10gb+me", "1g.10gb", "3g.40gb"]).is_ok());
        assert!(plan(&t, &["1g.10gb+me", "1g.10gb+me"])
            .unwrap_err()
            .to_string()
            .contains("at most 1"));
    }

    #[test]
    fn maximal_layouts_are_valid_and_cannot_grow() {
        let t = table("h100-80gb").unwrap();
        let all = maximal_layouts(&t);
        assert!(all.contains(&vec!["7g.80gb".to_string()]));
        assert!(all.contains(&vec!["4g.40gb".to_string(), "3g.40gb".to_string()]));
        assert!(all.contains(&vec!["1g.10gb".to_string(); 7]));
        for l in &all {
            let names: Vec<&str> = l.iter().map(String::as_str).collect();
            assert!(plan(&t, &names).is_ok(), "{l:?}");
            for p in &t.profiles {
                let mut more = names.clone();
                more.push(&p.name);
                assert!(plan(&t, &more).is_err(), "{l:?} + {} still fits", p.name);
            }
        }
        let mut dedup = all.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), all.len(), "each layout once");
    }
}
