//! The order of the layers, kept by the compiler's neighbour: a module may import modules of its own
//! layer and of the layers below it, never one above; and no file imports itself back through other
//! files (a circle of imports). docs/architecture.md draws the same order.
//!
//! Imports are read from the source as text: `use crate::…`, `use super::…`, paths written inline
//! (`crate::run::execute(…)`), and in the binary `migprof::…`. Test code (`#[cfg(test)]` items) and
//! the test support module `testing` may reach anything and are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

mod common;

/// A crate's layers, bottom first: each entry is one layer, its top-level modules side by side.
type Layers = &'static [&'static [&'static str]];

/// The library `profiler`, bottom first: each entry is one layer, its top-level modules side by side.
/// The binary's `commands` sit on top of all of them.
const PROFILER: Layers = &[
    &["provenance", "files", "heap", "mig"],
    &["gpu"],
    &["mps"],
    &["device"],
    &["run"],
    &["results"],
    &["load", "program"],
    &["server"],
    &["cell"],
    &["sweep", "capacity"],
    &["fleet", "report"],
    &["commands"],
];

/// The crate `workloads`, bottom first.
const WORKLOADS: Layers = &[
    &["precision"],
    &["kernels"],
    &["memory", "optim", "init"],
    &["graphs"],
    &["models"],
    &["zoo"],
    &["workload", "generation", "serving"],
];

/// What a source file imports: files relative to `src/`, each with the path as written.
struct Imports {
    files: BTreeMap<PathBuf, String>,
}

#[test]
fn no_module_imports_a_layer_above_its_own() {
    let mut wrong = Vec::new();
    for (crate_dir, layers, skip) in crates() {
        let graph = imports(&crate_dir, &skip);
        for (file, imports) in &graph {
            let Some(from) = layer_of(layers, top(file)) else {
                wrong.push(format!(
                    "{}: module `{}` is in no layer of this test",
                    file.display(),
                    top(file)
                ));
                continue;
            };
            for (to_file, written) in &imports.files {
                let to = layer_of(layers, top(to_file)).unwrap_or(usize::MAX);
                if to > from {
                    wrong.push(format!(
                        "{}/src/{}: `{written}` reaches `{}`, a layer above `{}` (the order, bottom first: {})",
                        crate_dir.parent().and_then(Path::file_name).unwrap().to_string_lossy(),
                        file.display(),
                        top(to_file),
                        top(file),
                        order(layers)
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the order of layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_file_imports_itself_back_through_others() {
    let mut circles = Vec::new();
    for (crate_dir, _, skip) in crates() {
        let graph = imports(&crate_dir, &skip);
        for circle in circles_of(&graph) {
            let names: Vec<String> = circle.iter().map(|f| f.display().to_string()).collect();
            circles.push(format!("{}: {}", crate_dir.display(), names.join(" -> ")));
        }
    }
    assert!(
        circles.is_empty(),
        "files that import each other:\n{}",
        circles.join("\n")
    );
}

#[test]
fn no_two_modules_import_each_other() {
    let mut circles = Vec::new();
    for (crate_dir, _, skip) in crates() {
        let modules = modules_of(&imports(&crate_dir, &skip));
        for circle in circles_of(&modules) {
            circles.push(format!("{}: {}", crate_dir.display(), said(&modules, &circle)));
        }
    }
    assert!(
        circles.is_empty(),
        "modules that import each other (a layer's modules sit side by side: neither may use the other's \
         parts both ways):\n{}",
        circles.join("\n")
    );
}

/// The order the test holds is the order docs/architecture.md draws: each crate's table of layers,
/// bottom first, names the same modules in the same layers.
#[test]
fn the_architecture_document_draws_the_test_s_layers() {
    let drawn = "# A\n## The layers, bottom first\n\n| layer | modules | what |\n|---|---|---|\n| 1 | `a`, `b` | x |\n\
                 | 2 | `c` | y, z |\n\nwords\n\n| layer | modules | what |\n|---|---|---|\n| 1 | `d` | w |\n\n## Next\n| 1 | `e` | v |\n";
    assert_eq!(
        layer_tables(drawn),
        [vec![vec!["a", "b"], vec!["c"]], vec![vec!["d"]]],
        "the document's tables are read row by row, the next section left out"
    );
    let doc = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/architecture.md");
    let text = std::fs::read_to_string(&doc).unwrap();
    let tables = layer_tables(&text);
    let expected: Vec<Vec<Vec<String>>> = [WORKLOADS, &PROFILER[..PROFILER.len() - 1]]
        .iter()
        .map(|layers| {
            layers
                .iter()
                .map(|l| l.iter().map(|m| m.to_string()).collect())
                .collect()
        })
        .collect();
    assert_eq!(
        tables, expected,
        "docs/architecture.md's tables of layers (workloads', then the profiler library's; the binary's \
         `commands` on top of them is said in words) differ from this test's WORKLOADS and PROFILER"
    );
}

/// Each table under "## The layers" of the architecture document: its rows' modules, bottom first.
fn layer_tables(text: &str) -> Vec<Vec<Vec<String>>> {
    let section = text
        .split("\n## ")
        .find(|s| s.starts_with("The layers"))
        .expect("docs/architecture.md has a section \"The layers, bottom first\"");
    let mut tables: Vec<Vec<Vec<String>>> = Vec::new();
    let mut in_table = false;
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let row = line.starts_with('|') && cells.len() > 3;
        if !row {
            in_table = false;
            continue;
        }
        if cells[1] == "layer" {
            tables.push(Vec::new());
            in_table = true;
            continue;
        }
        let Ok(n) = cells[1].parse::<usize>() else {
            continue; // the line under the head
        };
        let table = tables
            .last_mut()
            .filter(|_| in_table)
            .expect("a layer's row outside a table");
        assert_eq!(n, table.len() + 1, "docs/architecture.md: layer {n} is out of order");
        let modules = cells[2]
            .split(',')
            .map(|m| m.trim().trim_matches('`').to_string())
            .collect();
        table.push(modules);
    }
    tables
}

/// The graph of top-level modules: one node a module (`run`), an arrow where any of its files
/// imports a file of another.
fn modules_of(files: &BTreeMap<PathBuf, Imports>) -> BTreeMap<PathBuf, Imports> {
    let mut modules: BTreeMap<PathBuf, Imports> = BTreeMap::new();
    for (file, imports) in files {
        let from = PathBuf::from(top(file));
        let node = modules
            .entry(from.clone())
            .or_insert_with(|| Imports { files: BTreeMap::new() });
        for (to_file, written) in &imports.files {
            let to = PathBuf::from(top(to_file));
            if to != from {
                node.files
                    .entry(to)
                    .or_insert_with(|| format!("{}: {written}", file.display()));
            }
        }
    }
    modules
}

/// A circle of modules in words: each arrow with one import that makes it.
fn said(modules: &BTreeMap<PathBuf, Imports>, circle: &[PathBuf]) -> String {
    let mut arrows = Vec::new();
    for from in circle {
        for (to, example) in &modules[from].files {
            if circle.contains(to) {
                arrows.push(format!("{} -> {} ({example})", from.display(), to.display()));
            }
        }
    }
    arrows.join("; ")
}

/// The test's reading of imports, on files it writes: braces, `super`, inline paths, aliases, and
/// test items left out.
#[test]
fn imports_are_read_as_the_compiler_resolves_them() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    let write = |path: &str, text: &str| {
        let p = src.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    write("lib.rs", "pub mod a;\npub mod b;\n#[cfg(test)]\nmod testing;\n");
    write("a/mod.rs", "pub mod x;\npub mod y;\nuse self::x::X;\n");
    write(
        "a/x.rs",
        "use super::y::{Y, self as why};\n// use crate::b::Z;\npub struct X;\n",
    );
    write(
        "a/y.rs",
        "pub struct Y;\nfn f() { crate::b::z::go(); }\n#[cfg(test)]\nmod tests {\n    use crate::b::w;\n}\n",
    );
    write(
        "b/mod.rs",
        "pub mod z;\npub mod w;\nuse crate::{a::{x::X as Ex, y}, b::w::W};\n",
    );
    write("b/z.rs", "pub fn go() {}\n");
    write("b/w.rs", "pub struct W;\n");
    write("testing/mod.rs", "use crate::a::x;\n");
    let graph = imports(src, &["testing"]);
    let files = |f: &str| -> Vec<String> {
        graph[Path::new(f)]
            .files
            .keys()
            .map(|p| p.display().to_string())
            .collect()
    };
    assert_eq!(files("a/mod.rs"), ["a/x.rs"]);
    assert_eq!(files("a/x.rs"), ["a/y.rs"], "comments are not imports");
    assert_eq!(files("a/y.rs"), ["b/z.rs"], "test modules are not read");
    assert_eq!(files("b/mod.rs"), ["a/x.rs", "a/y.rs", "b/w.rs"]);
    assert!(!graph.contains_key(Path::new("testing/mod.rs")));
    assert!(circles_of(&graph).is_empty());
    // No file imports itself back, yet the modules import each other: `a/y.rs` uses `b/z.rs`, and
    // `b/mod.rs` uses `a/x.rs`.
    let modules = modules_of(&graph);
    assert_eq!(circles_of(&modules), [vec![PathBuf::from("a"), PathBuf::from("b")]]);
    assert_eq!(
        said(&modules, &[PathBuf::from("a"), PathBuf::from("b")]),
        "a -> b (a/y.rs: crate::b::z::go); b -> a (b/mod.rs: crate::a::x::X)"
    );
    write("a/y.rs", "pub struct Y;\n");
    assert!(
        circles_of(&modules_of(&imports(src, &["testing"]))).is_empty(),
        "b uses a, a no longer uses b"
    );
    write("a/y.rs", "pub struct Y;\nfn f() { crate::b::z::go(); }\n");
    write("b/z.rs", "use crate::a::y::Y;\npub fn go() {}\n");
    assert_eq!(
        circles_of(&imports(src, &["testing"])),
        [vec![PathBuf::from("a/y.rs"), PathBuf::from("b/z.rs")]]
    );
}

/// Each crate's `src/`, its layers, and the modules that are not read.
fn crates() -> Vec<(PathBuf, Layers, Vec<&'static str>)> {
    let profiler = Path::new(env!("CARGO_MANIFEST_DIR"));
    vec![
        (profiler.join("src"), PROFILER, vec!["testing"]),
        (profiler.join("../workloads/src"), WORKLOADS, vec![]),
    ]
}

fn layer_of(layers: &[&[&str]], module: &str) -> Option<usize> {
    layers.iter().position(|l| l.contains(&module))
}

fn order(layers: &[&[&str]]) -> String {
    layers.iter().map(|l| l.join(", ")).collect::<Vec<_>>().join(" → ")
}

/// The top-level module a file belongs to (`run/execute.rs`: `run`; `provenance.rs`: `provenance`).
fn top(file: &Path) -> &str {
    let first = file.components().next().unwrap().as_os_str().to_str().unwrap();
    first.strip_suffix(".rs").unwrap_or(first)
}

/// Every file under `src` but the crate roots and the `skip`ped modules, with what it imports.
fn imports(src: &Path, skip: &[&str]) -> BTreeMap<PathBuf, Imports> {
    let mut files = Vec::new();
    common::rust_files(src, &mut files);
    let mut graph = BTreeMap::new();
    for full in files {
        let rel = full.strip_prefix(src).unwrap().to_path_buf();
        if rel == Path::new("lib.rs") || rel == Path::new("main.rs") || skip.contains(&top(&rel)) {
            continue;
        }
        let module = module_path(&rel);
        let text = without_tests(&std::fs::read_to_string(&full).unwrap());
        let mut imported = BTreeMap::new();
        for path in paths(&text) {
            let segments = absolute(&module, &path);
            if let Some(target) = segments.and_then(|s| file_of(src, &s)) {
                if target != rel {
                    imported.entry(target).or_insert_with(|| path.join("::"));
                }
            }
        }
        graph.insert(rel, Imports { files: imported });
    }
    graph
}

/// `run/execute.rs` is `run::execute`, `run/mod.rs` is `run`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The source without comment lines and without the items under `#[cfg(test)]`.
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let trimmed = line.trim();
        if trimmed == "#[cfg(test)]" {
            // Skip the item: to its closing brace, or to its semicolon when it has no body.
            let (mut depth, mut opened) = (0i64, false);
            for item in lines.by_ref() {
                depth += item.matches('{').count() as i64 - item.matches('}').count() as i64;
                opened |= item.contains('{');
                if (opened && depth <= 0) || (!opened && item.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        if !trimmed.starts_with("//") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Every path the text imports or names from its own crate: `use` trees expanded, and inline paths.
/// Each begins with `crate`, `super`, `self` or `migprof` (the library, seen from the binary).
fn paths(text: &str) -> Vec<Vec<String>> {
    const ROOTS: [&str; 4] = ["crate", "super", "self", "migprof"];
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("use ") {
        let before_ok = at == 0 || !rest.as_bytes()[at - 1].is_ascii_alphanumeric() && rest.as_bytes()[at - 1] != b'_';
        let after = &rest[at + 4..];
        let end = after.find(';').unwrap_or(after.len());
        if before_ok && ROOTS.iter().any(|r| after.trim_start().starts_with(&format!("{r}::"))) {
            expand(&mut out, Vec::new(), after[..end].trim());
        }
        rest = &after[end.min(after.len())..];
    }
    // Inline paths: `crate::a::b(…)`, `super::c::D`.
    let bytes = text.as_bytes();
    for root in ROOTS.iter().filter(|r| **r != "self") {
        let pattern = format!("{root}::");
        let mut from = 0;
        while let Some(i) = text[from..].find(&pattern) {
            let start = from + i;
            from = start + pattern.len();
            if start > 0
                && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_' || bytes[start - 1] == b':')
            {
                continue;
            }
            let mut segments = vec![root.to_string()];
            let mut tail = &text[from..];
            loop {
                let n = tail
                    .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .unwrap_or(tail.len());
                if n == 0 {
                    break;
                }
                segments.push(tail[..n].to_string());
                match tail[n..].strip_prefix("::") {
                    Some(next) => tail = next,
                    None => break,
                }
            }
            out.push(segments);
        }
    }
    out
}

/// Adds the paths of one `use` tree (`a::{b, c::{d as e, self}}`) under `prefix`.
fn expand(out: &mut Vec<Vec<String>>, prefix: Vec<String>, tree: &str) {
    for part in split_top(tree) {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        match part.find('{') {
            Some(open) => {
                let mut head = prefix.clone();
                head.extend(segments(part[..open].trim_end_matches("::")));
                let inner = &part[open + 1..part.rfind('}').unwrap_or(part.len())];
                expand(out, head, inner);
            }
            None => {
                let mut path = prefix.clone();
                path.extend(segments(part.split(" as ").next().unwrap_or(part)));
                if path.last().is_some_and(|s| s == "self") {
                    path.pop();
                }
                out.push(path);
            }
        }
    }
}

fn segments(path: &str) -> impl Iterator<Item = String> + '_ {
    path.split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// Splits a `use` tree's list at the commas outside braces.
fn split_top(list: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    parts
}

/// A path as segments from the crate root, or `None` for what lies outside the crate.
fn absolute(module: &[String], path: &[String]) -> Option<Vec<String>> {
    // A file `a/b.rs` is module `a::b`, whose `super` is `a`; `a/mod.rs` is module `a`.
    let mut base: Vec<String> = module.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") | Some("migprof") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The file that defines the longest prefix of `segments` that is a module.
fn file_of(src: &Path, segments: &[String]) -> Option<PathBuf> {
    (1..=segments.len()).rev().find_map(|k| {
        let dir: PathBuf = segments[..k].iter().collect();
        [dir.with_extension("rs"), dir.join("mod.rs")]
            .into_iter()
            .find(|p| src.join(p).is_file())
    })
}

/// Each set of files that import one another in a circle (Tarjan's strongly connected components),
/// each sorted.
fn circles_of(graph: &BTreeMap<PathBuf, Imports>) -> Vec<Vec<PathBuf>> {
    struct State<'g> {
        graph: &'g BTreeMap<PathBuf, Imports>,
        index: BTreeMap<&'g Path, usize>,
        low: BTreeMap<&'g Path, usize>,
        stack: Vec<&'g Path>,
        on_stack: BTreeSet<&'g Path>,
        found: Vec<Vec<PathBuf>>,
    }
    fn visit<'g>(s: &mut State<'g>, node: &'g Path) {
        let i = s.index.len();
        s.index.insert(node, i);
        s.low.insert(node, i);
        s.stack.push(node);
        s.on_stack.insert(node);
        for next in s.graph.get(node).map(|n| n.files.keys()).into_iter().flatten() {
            let next = next.as_path();
            if !s.graph.contains_key(next) {
                continue;
            }
            if !s.index.contains_key(next) {
                visit(s, next);
                let low = s.low[next].min(s.low[node]);
                s.low.insert(node, low);
            } else if s.on_stack.contains(next) {
                let low = s.index[next].min(s.low[node]);
                s.low.insert(node, low);
            }
        }
        if s.low[node] == s.index[node] {
            let mut circle = Vec::new();
            while let Some(top) = s.stack.pop() {
                s.on_stack.remove(top);
                circle.push(top.to_path_buf());
                if top == node {
                    break;
                }
            }
            if circle.len() > 1 {
                circle.sort();
                s.found.push(circle);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in graph.keys() {
        if !s.index.contains_key(node.as_path()) {
            visit(&mut s, node);
        }
    }
    s.found
}
