//! How big the code's pieces are: a file over 1,000 lines or a function over 80 holds several things
//! that want names of their own. The bounds only go down: the files still over 1,000 lines are named
//! here (none may join them, and each leaves the list once split), and the count of long functions may
//! not rise above what it is. Tests (`#[cfg(test)]` modules) are not counted in a function's bound;
//! every `.rs` file of both crates, their tests and the benches is counted in a file's.

use std::path::{Path, PathBuf};

mod common;

/// The most lines a file may have.
const FILE_LINES: usize = 1_000;
/// The most lines a function may have.
const FUNCTION_LINES: usize = 80;
/// The files still over [`FILE_LINES`], each to be split.
const LONG_FILES: &[&str] = &[];
/// The most functions over [`FUNCTION_LINES`] outside tests.
const LONG_FUNCTIONS: usize = 15;

#[test]
fn no_file_passes_a_thousand_lines_but_those_named() {
    let root = repository();
    let mut long = Vec::new();
    for file in sources(&root) {
        let lines = std::fs::read_to_string(&file).unwrap().lines().count();
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        if lines > FILE_LINES && !LONG_FILES.contains(&name.as_str()) {
            long.push(format!("{name}: {lines} lines"));
        }
    }
    assert!(
        long.is_empty(),
        "files over {FILE_LINES} lines (split them by what they hold):\n{}",
        long.join("\n")
    );
    for name in LONG_FILES {
        let lines = std::fs::read_to_string(root.join(name)).map_or(0, |t| t.lines().count());
        assert!(
            lines > FILE_LINES,
            "{name} has {lines} lines now: take it off LONG_FILES, so that it stays under {FILE_LINES}"
        );
    }
}

#[test]
fn functions_over_eighty_lines_do_not_grow_in_number() {
    let root = repository();
    let mut long = Vec::new();
    for file in sources(&root)
        .into_iter()
        .filter(|f| !is_test_file(f.strip_prefix(&root).unwrap()))
    {
        let text = std::fs::read_to_string(&file).unwrap();
        for (name, lines) in functions(&text) {
            if lines > FUNCTION_LINES {
                long.push(format!(
                    "{}: {name}, {lines} lines",
                    file.strip_prefix(&root).unwrap().display()
                ));
            }
        }
    }
    assert!(
        long.len() <= LONG_FUNCTIONS,
        "{} functions over {FUNCTION_LINES} lines, where at most {LONG_FUNCTIONS} may be:\n{}",
        long.len(),
        long.join("\n")
    );
    assert!(
        long.len() == LONG_FUNCTIONS,
        "{} functions over {FUNCTION_LINES} lines: lower LONG_FUNCTIONS from {LONG_FUNCTIONS} to it",
        long.len()
    );
}

/// The reading of functions, on text written here: their lengths from `fn` to the closing brace at
/// their indentation, test modules left out, declarations without a body skipped.
#[test]
fn functions_are_measured_from_their_signature_to_their_closing_brace() {
    let text = "pub fn a(\n    x: u8,\n) -> u8 {\n    x\n}\n\nimpl T {\n    fn b(&self) {\n        if c {\n        }\n    }\n    fn f(&self) {}\n}\n\
                trait U {\n    fn d(&self);\n}\n#[cfg(test)]\nmod tests {\n    fn e() {\n    }\n}\n";
    assert_eq!(
        functions(text),
        [("a".to_string(), 5), ("b".to_string(), 4), ("f".to_string(), 1)],
        "a spans 5 lines, b 4, f one; d has no body; e is a test's"
    );
}

/// The repository's root.
fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Every `.rs` file of both crates (sources and tests) and of the benches.
fn sources(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in [
        "profiler/src",
        "profiler/tests",
        "workloads/src",
        "workloads/tests",
        "benches",
    ] {
        common::rust_files(&root.join(dir), &mut files);
    }
    files.sort();
    files
}

/// Integration tests and their support (`file` relative to the repository): a test's length is its
/// own business.
fn is_test_file(file: &Path) -> bool {
    file.components().any(|c| c.as_os_str() == "tests") || file.file_name().is_some_and(|n| n == "tests.rs")
}

/// Each function with a body outside `#[cfg(test)]` modules: its name and its lines, from the line
/// of `fn` to the line of its closing brace, at the indentation it began with.
fn functions(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0].trim() == "#[cfg(test)]" && w[1].trim_start().contains("mod tests"))
        .unwrap_or(lines.len());
    let mut out = Vec::new();
    let mut i = 0;
    while i < end {
        let line = lines[i];
        let Some(name) = function_name(line) else {
            i += 1;
            continue;
        };
        let indent = line.len() - line.trim_start().len();
        // The signature ends at its body's brace, or at a semicolon for a declaration.
        let Some(open) = (i..end).find(|&j| lines[j].contains('{') || lines[j].trim_end().ends_with(';')) else {
            break;
        };
        if !lines[open].contains('{') {
            i = open + 1;
            continue;
        }
        // A body that closes on the line it opens (`fn f() {}`).
        if lines[open].matches('{').count() == lines[open].matches('}').count() {
            out.push((name, open - i + 1));
            i = open + 1;
            continue;
        }
        let close = (open + 1..end)
            .find(|&j| {
                let l = lines[j];
                l.len() - l.trim_start().len() == indent && l.trim_start().starts_with('}')
            })
            .unwrap_or(end - 1);
        out.push((name, close - i + 1));
        i = close + 1;
    }
    out
}

/// The name of the function a line begins, if it begins one.
fn function_name(line: &str) -> Option<String> {
    let mut rest = line.trim_start();
    for prefix in [
        "pub(crate) ",
        "pub(super) ",
        "pub ",
        "const ",
        "unsafe ",
        "async ",
        "extern \"C\" ",
    ] {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let name = rest.strip_prefix("fn ")?;
    let end = name.find(|c: char| !(c.is_alphanumeric() || c == '_'))?;
    Some(name[..end].to_string())
}
