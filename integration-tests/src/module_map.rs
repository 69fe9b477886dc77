//! The module map of `docs/architecture.md` is the tree: every Rust file under the mapped source folders is listed
//! in the map, and the map lists nothing that is not there. The map is the `text` block under the
//! heading `## Module map`: a root (`worker/src/`) at no indent, then one entry per line,
//! indented two spaces per folder level, its name first (folders end in `/`), what it owns after.
//! Every `mod.rs` stays thin (under 250 lines).

use std::collections::BTreeSet;
use std::path::Path;

use crate::repo_files::{CRATES, files};

/// The Rust files the map names, as paths from the repository root.
fn mapped(page: &str) -> Result<(BTreeSet<String>, BTreeSet<String>), String> {
    let section = page
        .split_once("## Module map")
        .ok_or("docs/architecture.md has no `## Module map` heading")?
        .1;
    let block = section
        .split_once("```text\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .ok_or("no ```text block under `## Module map`")?
        .0;
    let (mut roots, mut files) = (BTreeSet::new(), BTreeSet::new());
    let mut folders: Vec<String> = Vec::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let indent = line.len() - line.trim_start().len();
        if indent % 2 != 0 {
            return Err(format!("odd indent: {line:?}"));
        }
        let level = indent / 2;
        let name = line.split_whitespace().next().expect("not empty");
        if level > folders.len() {
            return Err(format!("indented deeper than its folder: {line:?}"));
        }
        folders.truncate(level);
        if level == 0 {
            roots.insert(name.to_owned());
        }
        if name.ends_with('/') {
            folders.push(name.to_owned());
        } else {
            files.insert(format!("{}{name}", folders.concat()));
        }
    }
    Ok((roots, files))
}

/// The Rust files under `root` (a folder of the repository), as paths from the repository root.
fn tree(repo: &Path, root: &str) -> BTreeSet<String> {
    files(&repo.join(root), "rs")
        .iter()
        .map(|f| f.strip_prefix(repo).expect("in the repo").to_string_lossy().into_owned())
        .collect()
}

#[test]
fn the_module_map_is_the_tree() {
    let repo = crate::stack::repo_root();
    let page = std::fs::read_to_string(repo.join("docs/architecture.md")).expect("docs/architecture.md");
    let (roots, listed) = mapped(&page).unwrap();
    assert!(roots.contains("worker/src/") && roots.contains("producer/src/"), "{roots:?}");
    let present: BTreeSet<String> = roots.iter().flat_map(|root| tree(&repo, root)).collect();
    let missing: Vec<_> = present.difference(&listed).collect();
    let stale: Vec<_> = listed.difference(&present).collect();
    assert!(missing.is_empty(), "in the tree, not in the module map: {missing:?}");
    assert!(stale.is_empty(), "in the module map, not in the tree: {stale:?}");
}

#[test]
fn a_map_entry_belongs_to_the_folder_above_it() {
    let page = "## Module map\n\n```text\nw/\n  a.rs   x\n  f/     y\n    b.rs z\n  c.rs   t\n```\n";
    let (roots, files) = mapped(page).unwrap();
    assert_eq!(roots, BTreeSet::from(["w/".to_owned()]));
    assert_eq!(
        files,
        BTreeSet::from(["w/a.rs".to_owned(), "w/f/b.rs".to_owned(), "w/c.rs".to_owned()])
    );
    assert!(mapped("## Module map\n\n```text\nw/\n    deep.rs x\n```\n").is_err());
}

/// A `mod.rs` says what its folder is made of and holds little else: under 250 lines, so that
/// what a folder does lives in files named for it.
#[test]
fn every_mod_rs_is_thin() {
    const MOST: usize = 250;
    let repo = crate::stack::repo_root();
    let mod_rs: Vec<String> = CRATES
        .iter()
        .flat_map(|root| tree(&repo, root))
        .filter(|f| f.ends_with("/mod.rs"))
        .collect();
    let thick: Vec<String> = mod_rs
        .iter()
        .map(|f| (f, std::fs::read_to_string(repo.join(f)).expect("readable").lines().count()))
        .filter(|(_, lines)| *lines >= MOST)
        .map(|(f, lines)| format!("{f}: {lines} lines"))
        .collect();
    assert!(!mod_rs.is_empty(), "no mod.rs found");
    assert!(thick.is_empty(), "mod.rs files of {MOST} lines or more: {thick:?}");
}
