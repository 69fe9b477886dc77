//! The files of each crate import one another without a cycle, so that each can be read, and
//! changed, knowing only what is below it.
//!
//! A file's imports are the `crate::…` and `super::…` paths of its code (comments and its
//! `#[cfg(test)] mod tests` block left out), each resolved to the deepest module file it names.
//! A file naming one of its ancestors (`super::Bucket` in a child of `models/`) is not counted:
//! a parent declares its children and a child may use what its parent defines, as `mod.rs` files
//! are meant to be used. Every other pair of files that can reach each other is a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::repo_files::{CRATES, files};

/// A module: its path of names from the crate root (`["pipeline", "task"]`).
type Module = Vec<String>;

/// A crate's module files: `a/b.rs` and `a/b/mod.rs` are module `a::b`, `lib.rs` the root. A
/// binary's root (`main.rs`, `bin/`) starts another crate and is left out.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    for path in files(src, "rs") {
        let rel = path.strip_prefix(src).expect("under src");
        if rel == Path::new("main.rs") || rel.starts_with("bin") {
            continue;
        }
        let mut module: Module = rel.with_extension("").iter().map(|p| p.to_string_lossy().into_owned()).collect();
        if module.last().is_some_and(|l| l == "mod" || l == "lib") {
            module.pop();
        }
        out.insert(module, path);
    }
    out
}

/// A file's text as the crate compiles it outside tests: without comments, and without the
/// `#[cfg(test)] mod tests` block (which by convention ends the file).
fn code(text: &str) -> String {
    let end = text.find("#[cfg(test)]\nmod tests").unwrap_or(text.len());
    text[..end]
        .lines()
        .map(|line| line.split_once("//").map_or(line, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The end of the brace group whose opening brace `s` follows: the index of its closing brace.
fn group_end(s: &str) -> usize {
    let mut depth = 0;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return i,
            '}' => depth -= 1,
            _ => {}
        }
    }
    s.len()
}

/// The paths a path or a `use` tree spells from `s` on: `a::b::{c, d::{e, f}}` gives `a::b::c`,
/// `a::b::d::e` and `a::b::d::f`.
fn paths(s: &str) -> Vec<Module> {
    let mut prefix = Module::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start();
        if let Some(inner) = rest.strip_prefix('{') {
            let group = &inner[..group_end(inner)];
            let mut items = Vec::new();
            let (mut depth, mut start) = (0, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(&group[start..i]);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            items.push(&group[start..]);
            return items
                .into_iter()
                .filter(|i| !i.trim().is_empty())
                .flat_map(paths)
                .map(|p| prefix.iter().cloned().chain(p).collect())
                .collect();
        }
        let len = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        if len == 0 {
            break;
        }
        prefix.push(rest[..len].to_owned());
        rest = &rest[len..];
        match rest.strip_prefix("::") {
            Some(r) => rest = r,
            None => break,
        }
    }
    vec![prefix]
}

/// The modules the code of `module` imports, among `known`, leaving out its ancestors and itself.
fn imports(module: &Module, code: &str, known: &BTreeMap<Module, PathBuf>) -> BTreeSet<Module> {
    let mut out = BTreeSet::new();
    for keyword in ["crate::", "super::"] {
        for (at, _) in code.match_indices(keyword) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue; // `sluice_service::…`, or the second `super::` of `super::super::`
            }
            let mut base: Module = if keyword == "crate::" {
                Module::new()
            } else {
                module[..module.len().saturating_sub(1)].to_vec()
            };
            let mut start = at + keyword.len();
            while code[start..].starts_with("super::") {
                base.pop();
                start += "super::".len();
            }
            for path in paths(&code[start..]) {
                let full: Module = base.iter().cloned().chain(path).collect();
                let target = (1..=full.len()).rev().map(|k| full[..k].to_vec()).find(|m| known.contains_key(m));
                if let Some(target) = target.filter(|t| !module.starts_with(t)) {
                    out.insert(target);
                }
            }
        }
    }
    out
}

/// The groups of modules that import each other, directly or not: strongly connected
/// components with more than one module.
fn cycles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<BTreeSet<Module>> {
    let reach = |from: &Module| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.clone()];
        while let Some(m) = stack.pop() {
            for next in graph.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    stack.push(next.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&Module, BTreeSet<Module>> = graph.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<BTreeSet<Module>> = Vec::new();
    for (m, from_m) in &reached {
        if out.iter().any(|c| c.contains(*m)) {
            continue;
        }
        let group: BTreeSet<Module> = from_m
            .iter()
            .filter(|o| reached.get(o).is_some_and(|r| r.contains(*m)))
            .cloned()
            .collect();
        if group.len() > 1 {
            out.push(group);
        }
    }
    out
}

#[test]
fn no_crate_has_an_import_cycle() {
    let repo = crate::stack::repo_root();
    let mut found = Vec::new();
    for src in CRATES {
        let known = modules(&repo.join(src));
        assert!(known.len() > 3, "{src}: {known:?}");
        let graph: BTreeMap<Module, BTreeSet<Module>> = known
            .iter()
            .map(|(m, file)| {
                (
                    m.clone(),
                    imports(m, &code(&std::fs::read_to_string(file).expect("readable")), &known),
                )
            })
            .collect();
        for group in cycles(&graph) {
            let edges: Vec<String> = group
                .iter()
                .flat_map(|m| {
                    graph[m]
                        .iter()
                        .filter(|t| group.contains(*t))
                        .map(move |t| format!("{} -> {}", m.join("/"), t.join("/")))
                })
                .collect();
            found.push(format!("{src}: {}", edges.join(", ")));
        }
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn imports_are_read_from_paths_and_use_trees() {
    let m = |s: &str| -> Module { s.split('/').map(str::to_owned).collect() };
    let known: BTreeMap<Module, PathBuf> = ["a", "a/b", "a/c", "d", "d/e"]
        .into_iter()
        .map(|s| (m(s), PathBuf::new()))
        .collect();
    let code = code(
        "use crate::a::{b::{X, Y}, c as C};\nuse super::super::super::d::e::Z; // crate::a::c\nfn f() { sluice_service::crate::a; crate::d::g(); super::Up; }\n#[cfg(test)]\nmod tests { use crate::a::b; }",
    );
    let found = imports(&m("a/c/x"), &code, &known);
    // a/c is an ancestor of a/c/x; `super::Up` names a/c too; the test block and comment count not.
    assert_eq!(found, [m("a/b"), m("d"), m("d/e")].into_iter().collect());
    let graph: BTreeMap<Module, BTreeSet<Module>> = [
        (m("a"), [m("b")].into()),
        (m("b"), [m("c")].into()),
        (m("c"), [m("a")].into()),
        (m("d"), [m("a")].into()),
    ]
    .into_iter()
    .collect();
    assert_eq!(cycles(&graph), vec![[m("a"), m("b"), m("c")].into_iter().collect::<BTreeSet<_>>()]);
}
