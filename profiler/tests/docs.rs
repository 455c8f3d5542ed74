//! The docs stay true as the code moves: every flag of every command and every key of the sweep file is
//! in the guide, every link and repository path the README and docs/ name exists, and the README stays
//! short. (The columns of each table are checked against docs/schema.md where the tables are written:
//! `results::runs` and `tests/load.rs`.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use migprof::sweep::file::SweepFile;

mod common;
use common::*;

/// The commands `migprof --help` lists, subcommands of `mig` included, as argument lists.
fn commands() -> Vec<Vec<String>> {
    let listed = |args: &[&str]| -> Vec<String> {
        let o = run(&[args, &["--help"]].concat());
        assert!(o.status.success(), "{}", text(&o));
        let help = String::from_utf8(o.stdout).unwrap();
        let section = help
            .split("Commands:")
            .nth(1)
            .expect("a list of commands")
            .split("\n\n")
            .next()
            .unwrap();
        section
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .map(str::to_string)
            .collect()
    };
    let mut all = Vec::new();
    for c in listed(&[]) {
        if c == "mig" {
            all.extend(listed(&["mig"]).into_iter().map(|s| vec!["mig".to_string(), s]));
        } else {
            all.push(vec![c]);
        }
    }
    all
}

/// The long flags a command's `--help` lists.
fn long_flags(command: &[String]) -> BTreeSet<String> {
    let args: Vec<&str> = command.iter().map(String::as_str).chain(["--help"]).collect();
    let o = run(&args);
    assert!(o.status.success(), "{}", text(&o));
    let help = String::from_utf8(o.stdout).unwrap();
    help.lines()
        .map(str::trim_start)
        .filter(|l| l.starts_with('-'))
        .flat_map(|l| {
            l.split([' ', ',', '=', '<', '['])
                .filter(|w| w.starts_with("--"))
                .map(str::to_string)
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

#[test]
fn every_flag_of_every_command_is_in_the_guide() {
    let guide = repo_file("docs/guide.md");
    let commands = commands();
    assert!(commands.len() >= 14, "{commands:?}");
    let (mut missing, mut checked) = (Vec::new(), 0);
    for c in &commands {
        let flags = long_flags(c);
        checked += flags.len();
        for f in undocumented(&guide, flags.iter().map(String::as_str)) {
            missing.push(format!("migprof {} {f}", c.join(" ")));
        }
    }
    assert!(checked > 80, "only {checked} flags read from the commands' help");
    assert!(missing.is_empty(), "docs/guide.md lacks: {missing:?}");
}

/// The keys a section of the sweep file accepts, as the parser says when given one it does not.
fn keys_of(toml: &str) -> BTreeSet<String> {
    let err = format!("{:#}", SweepFile::parse(toml).unwrap_err());
    let list = err
        .split("expected one of")
        .nth(1)
        .unwrap_or_else(|| panic!("no list of keys in: {err}"));
    // `a`, `b`, `c` (the list ends at the first character after the last backtick pair).
    list.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

#[test]
fn every_key_of_the_sweep_file_is_in_the_guide() {
    let guide = repo_file("docs/guide.md");
    let target = "[[targets]]\nlabel = \"a\"\ndevice = \"cpu\"\n";
    let sections = [
        ("top level", format!("name = \"s\"\nbogus = 1\n{target}")),
        ("[defaults]", format!("name = \"s\"\n{target}[defaults]\nbogus = 1\n")),
        ("[[targets]]", "name = \"s\"\n[[targets]]\nlabel = \"a\"\ndevice = \"cpu\"\nbogus = 1\n".to_string()),
        ("[[matrix]]", format!("name = \"s\"\n{target}[[matrix]]\nmodels = [\"resnet_tiny\"]\nbatches = [1]\nbogus = 1\n")),
        ("[[capacity]]", format!("name = \"s\"\n{target}[[capacity]]\nmodels = [\"resnet_tiny\"]\nslo_p99_ms = 50\nbogus = 1\n")),
        ("[[groups]]", format!("name = \"s\"\n{target}[[groups]]\nlabel = \"g\"\ntargets = [\"a\"]\nbogus = 1\n")),
        ("[[programs]]", format!("name = \"s\"\n{target}[[programs]]\nname = \"p\"\ncommand = [\"true\"]\nbogus = 1\n")),
        (
            "[groups.busy]",
            format!("name = \"s\"\n{target}[[groups]]\nlabel = \"g\"\ntargets = [\"a\"]\n[groups.busy]\nmodel = \"resnet_tiny\"\nbatch = 1\nbogus = 1\n"),
        ),
    ];
    let mut missing = Vec::new();
    for (section, toml) in &sections {
        let keys = keys_of(toml);
        assert!(keys.len() >= 2, "{section}: {keys:?}");
        for k in undocumented(&guide, keys.iter().map(String::as_str)) {
            missing.push(format!("{section} {k}"));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/guide.md lacks these sweep-file keys: {missing:?}"
    );
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The README and every page of docs/, with their text.
fn pages() -> Vec<(PathBuf, String)> {
    let mut pages = vec![PathBuf::from("README.md")];
    for e in std::fs::read_dir(repo().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            pages.push(p.strip_prefix(repo()).unwrap().to_path_buf());
        }
    }
    pages
        .into_iter()
        .map(|p| (p.clone(), std::fs::read_to_string(repo().join(&p)).unwrap()))
        .collect()
}

/// The folders a path named in the docs starts with, when it names a file of the repository.
const TOP: [&str; 7] = [
    "workloads/",
    "profiler/",
    "benches/",
    "scripts/",
    "docs/",
    "data/mig/",
    ".ci/",
];

#[test]
fn every_link_and_path_the_docs_name_exists() {
    let mut missing = Vec::new();
    for (page, text) in pages() {
        let folder = page.parent().unwrap_or(Path::new(""));
        // Relative links: [text](target), target without a scheme; the anchor is left out.
        for part in text.split("](").skip(1) {
            let target = part.split(')').next().unwrap().split('#').next().unwrap();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            if !repo().join(folder).join(target).exists() {
                missing.push(format!("{}: link {target}", page.display()));
            }
        }
        // Paths in backticks that name files or folders of the repository.
        for (i, chunk) in text.split('`').enumerate() {
            let path = chunk.trim_end_matches(['/', ':', ',']);
            let named = i % 2 == 1 && TOP.iter().any(|t| path.starts_with(t) || format!("{path}/") == *t);
            if !named || path.contains(['*', '<', '…', ' ', '{', '$']) {
                continue;
            }
            if !repo().join(path).exists() {
                missing.push(format!("{}: {path}", page.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named in the docs but not in the repository:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_readme_is_read_in_five_minutes() {
    let lines = repo_file("README.md").lines().count();
    assert!(lines <= 300, "README.md has {lines} lines; at most 300");
}

#[test]
fn the_checks_of_the_docs_find_what_is_missing() {
    // The helpers the tests above rely on, on a page that lacks things.
    let page = "`--out` and `name` are here.";
    assert_eq!(
        undocumented(page, ["--out", "--seed", "name", "label"]),
        ["--seed", "label"]
    );
    let keys = keys_of("name = \"s\"\nbogus = 1\n[[targets]]\nlabel = \"a\"\ndevice = \"cpu\"\n");
    assert!(
        keys.contains("name") && keys.contains("targets") && !keys.contains("bogus"),
        "{keys:?}"
    );
    let flags = long_flags(&["models".to_string()]);
    assert!(flags.is_empty(), "models takes no flags: {flags:?}");
    let flags = long_flags(&["merge".to_string()]);
    assert_eq!(flags.into_iter().collect::<Vec<_>>(), ["--out"]);
}
