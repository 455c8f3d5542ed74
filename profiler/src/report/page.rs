//! The report's page: sections of blocks (paragraphs, tables, charts), the helpers that make them,
//! and their two renderings, one self-contained HTML page and Markdown with its charts as files.

use std::fmt::Write as _;

use super::chart;

/// A part of a section.
#[derive(Debug, Clone, PartialEq)]
pub enum Block {
    Text(String),
    Table {
        head: Vec<String>,
        rows: Vec<Vec<String>>,
    },
    /// A chart: a file name for the Markdown form, the SVG, and its legend (a name per colour of
    /// [`chart::PALETTE`], or grey), written beside it so that it hides no data.
    Chart {
        name: String,
        svg: String,
        legend: Vec<(String, Option<usize>)>,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Section {
    pub id: String,
    pub title: String,
    /// 2 for a top section, 3 for one inside it.
    pub level: u8,
    pub blocks: Vec<Block>,
}

pub fn fmt(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |v| format!("{v:.digits$}"))
}

pub fn table(head: &[&str], rows: Vec<Vec<String>>) -> Block {
    Block::Table {
        head: head.iter().map(|h| h.to_string()).collect(),
        rows,
    }
}

pub fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

const CSS: &str = "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.4}\
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}h3{margin-top:1.5em}\
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}\
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}figure{margin:1em 0}svg{max-width:100%;height:auto}\
nav ul{columns:2}figcaption{font-size:.9em}";

/// The report as one HTML page.
pub fn html(sections: &[Section]) -> String {
    let mut out = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>migprof report</title>\n",
    );
    let _ = writeln!(out, "<style>{CSS}</style>\n</head>\n<body>\n<h1>migprof report</h1>");
    out += "<nav>\n<h2 id=\"contents\">Contents</h2>\n<ul>\n";
    for s in sections.iter().filter(|s| s.level == 2) {
        let _ = writeln!(out, "<li><a href=\"#{}\">{}</a></li>", s.id, escape(&s.title));
    }
    out += "</ul>\n</nav>\n";
    for s in sections {
        let _ = writeln!(out, "<h{l} id=\"{}\">{}</h{l}>", s.id, escape(&s.title), l = s.level);
        for b in &s.blocks {
            match b {
                Block::Text(t) => {
                    let _ = writeln!(out, "<p>{}</p>", escape(t));
                }
                Block::Table { head, rows } => {
                    out += "<table>\n<thead><tr>";
                    for h in head {
                        let _ = write!(out, "<th>{}</th>", escape(h));
                    }
                    out += "</tr></thead>\n<tbody>\n";
                    for r in rows {
                        out += "<tr>";
                        for c in r {
                            let _ = write!(out, "<td>{}</td>", escape(c));
                        }
                        out += "</tr>\n";
                    }
                    out += "</tbody>\n</table>\n";
                }
                Block::Chart { svg, legend, .. } => {
                    // plotters writes an XML document; inline, the SVG element is what is needed.
                    let start = svg.find("<svg").unwrap_or(0);
                    let keys: Vec<String> = legend
                        .iter()
                        .map(|(name, c)| {
                            format!(
                                "<span style=\"color:{}\">&#9632;</span>&nbsp;{}",
                                c.map_or("#787878".into(), chart::css),
                                escape(name)
                            )
                        })
                        .collect();
                    let _ = writeln!(
                        out,
                        "<figure>\n{}\n<figcaption>{}</figcaption>\n</figure>",
                        svg[start..].trim_end(),
                        keys.join(" &nbsp; ")
                    );
                }
            }
        }
    }
    out += "</body>\n</html>\n";
    out
}

/// The report as Markdown, its charts as files in `folder` (relative to the Markdown file).
pub fn markdown(sections: &[Section], folder: &str) -> String {
    let mut out = String::from("# migprof report\n\n## Contents\n\n");
    for s in sections.iter().filter(|s| s.level == 2) {
        let _ = writeln!(out, "- [{}](#{})", s.title, s.id);
    }
    for s in sections {
        let _ = writeln!(
            out,
            "\n<a id=\"{}\"></a>\n\n{} {}\n",
            s.id,
            "#".repeat(s.level as usize),
            s.title
        );
        for b in &s.blocks {
            match b {
                Block::Text(t) => {
                    let _ = writeln!(out, "{t}\n");
                }
                Block::Table { head, rows } => {
                    let cell = |c: &str| c.replace('|', "\\|");
                    let _ = writeln!(
                        out,
                        "| {} |",
                        head.iter().map(|h| cell(h)).collect::<Vec<_>>().join(" | ")
                    );
                    let _ = writeln!(out, "|{}", "---|".repeat(head.len()));
                    for r in rows {
                        let _ = writeln!(out, "| {} |", r.iter().map(|c| cell(c)).collect::<Vec<_>>().join(" | "));
                    }
                    out.push('\n');
                }
                Block::Chart { name, legend, .. } => {
                    let keys: Vec<String> = legend
                        .iter()
                        .map(|(n, c)| format!("{n} ({})", c.map_or("#787878".into(), chart::css)))
                        .collect();
                    let _ = writeln!(out, "![{name}]({folder}/{name})\n\nColours: {}\n", keys.join(", "));
                }
            }
        }
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}
