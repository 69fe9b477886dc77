//! The manual holds together: every relative link of the README and `docs/` (and every alert's
//! runbook) names a file that exists and, with a `#fragment`, a heading of it; and every `SLUICE_*`
//! variable the binaries accept has exactly one row in the manual's tables, with no row for a
//! variable nothing reads.
//!
//! The variables accepted are clap's (the worker's and the producer's commands, walked whole), and
//! those the sources name in an `env = "…"` attribute or read with `var("…")`, `var_os("…")` or the
//! benchmark's `env_or("…", default)`: the worker's subcommands, `sluice-bench`, `sluice-demo`, the
//! test harness and the test suites' knobs. A row documents the
//! variables named alone in backticks in its first cell (`SLUICE_X`, not `SLUICE_X=1`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::repo_files::files;

/// The manual's pages: the README and every Markdown file under `docs/`.
fn pages(repo: &Path) -> Vec<PathBuf> {
    let mut out = vec![repo.join("README.md")];
    out.extend(files(&repo.join("docs"), "md"));
    out.sort();
    out
}

/// A page's text outside fenced code blocks and inline code spans: what renders as prose.
fn prose(markdown: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || line.starts_with("    ") {
            continue;
        }
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
            } else if !in_code {
                out.push(c);
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of a page's inline links, `[text](target)`.
fn links(markdown: &str) -> Vec<String> {
    let text = prose(markdown);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].to_owned());
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, spaces to hyphens, other punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings.
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Why `target`, a link in the page `from`, does not resolve (None: it does).
fn broken(from: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, fragment) = target.split_once('#').map_or((target, None), |(p, f)| (p, Some(f)));
    let file = if path.is_empty() {
        from.to_path_buf()
    } else {
        from.parent().expect("in a folder").join(path)
    };
    if !file.exists() {
        return Some(format!("{} does not exist", file.display()));
    }
    let fragment = fragment.filter(|f| !f.is_empty())?;
    if file.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let text = std::fs::read_to_string(&file).expect("readable");
    (!anchors(&text).contains(fragment)).then(|| format!("{} has no heading #{fragment}", file.display()))
}

/// Every `SLUICE_*` variable of a clap command and its subcommands.
fn clap_env(command: &clap::Command, out: &mut BTreeSet<String>) {
    for arg in command.get_arguments() {
        if let Some(env) = arg.get_env().and_then(|e| e.to_str()).filter(|e| e.starts_with("SLUICE_")) {
            out.insert(env.to_owned());
        }
    }
    for sub in command.get_subcommands() {
        clap_env(sub, out);
    }
}

/// The `SLUICE_*` names in `text` in a string literal right after `prefix` (whitespace between).
fn named_after(text: &str, prefix: &str, out: &mut BTreeSet<String>) {
    for (at, _) in text.match_indices(prefix) {
        let Some(rest) = text[at + prefix.len()..].trim_start().strip_prefix('"') else {
            continue;
        };
        let name = &rest[..rest.find('"').unwrap_or(rest.len())];
        if name.starts_with("SLUICE_") {
            out.insert(name.to_owned());
        }
    }
}

/// The variables the binaries accept.
fn accepted(repo: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    clap_env(&sluice_worker::config::Config::command(), &mut out);
    clap_env(&sluice_producer::config::Cli::command(), &mut out);
    for src in [
        "worker/src",
        "producer/src",
        "service/src",
        "schemas/src",
        "integration-tests/src",
        "integration-tests/tests",
    ] {
        for file in files(&repo.join(src), "rs") {
            let text = std::fs::read_to_string(&file).expect("readable");
            for prefix in ["env = ", "var(", "var_os(", "env_or("] {
                named_after(&text, prefix, &mut out);
            }
        }
    }
    out
}

/// The variables each table row of the manual documents (in its first cell), counted.
fn documented(repo: &Path) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for page in pages(repo) {
        let text = std::fs::read_to_string(&page).expect("readable");
        for line in text.lines().filter(|l| l.starts_with('|')) {
            let cell = line.split('|').nth(1).unwrap_or_default();
            let names = cell.split('`').skip(1).step_by(2);
            for name in
                names.filter(|n| n.starts_with("SLUICE_") && n.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'))
            {
                out.entry(name.to_owned())
                    .or_default()
                    .push(page.strip_prefix(repo).expect("in the repo").display().to_string());
            }
        }
    }
    out
}

#[test]
fn every_relative_link_of_the_manual_resolves() {
    let repo = crate::stack::repo_root();
    let mut bad = Vec::new();
    for page in pages(&repo) {
        let text = std::fs::read_to_string(&page).expect("readable");
        for target in links(&text) {
            if let Some(why) = broken(&page, &target) {
                bad.push(format!(
                    "{}: ({target}): {why}",
                    page.strip_prefix(&repo).expect("in the repo").display()
                ));
            }
        }
    }
    let alerts = std::fs::read_to_string(repo.join("helm/sluice/files/alerts.yaml")).expect("the alert rules");
    let runbooks: Vec<_> = alerts
        .lines()
        .filter_map(|l| l.trim().strip_prefix("runbook: "))
        .map(|r| r.trim_matches('"'))
        .collect();
    assert!(!runbooks.is_empty(), "the alert rules have no runbook annotations");
    for runbook in runbooks {
        if let Some(why) = broken(&repo.join("alerts.yaml"), runbook) {
            bad.push(format!("helm/sluice/files/alerts.yaml: runbook {runbook}: {why}"));
        }
    }
    assert!(bad.is_empty(), "broken links:\n{}", bad.join("\n"));
}

#[test]
fn every_variable_the_binaries_accept_is_documented_once() {
    let repo = crate::stack::repo_root();
    let accepted = accepted(&repo);
    assert!(
        accepted.contains("SLUICE_KAFKA_BROKERS") && accepted.contains("SLUICE_BENCH_TASKS"),
        "{accepted:?}"
    );
    let documented = documented(&repo);
    let missing: Vec<_> = accepted.iter().filter(|v| !documented.contains_key(*v)).collect();
    let twice: Vec<_> = documented.iter().filter(|(_, rows)| rows.len() > 1).collect();
    let stale: Vec<_> = documented.keys().filter(|v| !accepted.contains(*v)).collect();
    assert!(missing.is_empty(), "accepted, with no row in the manual's tables: {missing:?}");
    assert!(twice.is_empty(), "documented in more than one row: {twice:?}");
    assert!(stale.is_empty(), "a row in the manual, read by no binary: {stale:?}");
}

#[test]
fn links_and_anchors_are_read_as_github_renders_them() {
    assert_eq!(
        slug(" Consumer group protocol (`sluice-bench group`)"),
        "consumer-group-protocol-sluice-bench-group"
    );
    assert_eq!(slug("The crash guard's cost"), "the-crash-guards-cost");
    let page = "# Title\n\nSee [a](b.md#c) and `[not](a link)`.\n\n```\n[no](code)\n# not a heading\n```\n## Two words\n";
    assert_eq!(links(page), vec!["b.md#c".to_owned()]);
    assert_eq!(anchors(page), BTreeSet::from(["title".to_owned(), "two-words".to_owned()]));
    // Built with format! so that this file names no variable the scan of the sources would find.
    let (a, b) = (format!("{}A", "SLUICE_"), format!("{}B", "SLUICE_"));
    let source = format!("#[arg(env = \"{a}\")] std::env::var(\n  \"{b}\") var(\"OTHER\") cmd.env(\"{a}X\", \"1\")");
    let mut names = BTreeSet::new();
    named_after(&source, "env = ", &mut names);
    named_after(&source, "var(", &mut names);
    assert_eq!(names, BTreeSet::from([a, b]));
}
