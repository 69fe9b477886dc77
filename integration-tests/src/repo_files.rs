//! The repository's files, for the tests that hold its structure and its manual to the code.

use std::path::{Path, PathBuf};

/// The source folders of the crates whose structure is held: their import graph, their thin
/// `mod.rs` files.
pub(crate) const CRATES: [&str; 4] = ["worker/src", "producer/src", "service/src", "schemas/src"];

/// Every file under `dir` (at any depth) whose extension is `ext`.
pub(crate) fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("readable").path();
        if path.is_dir() {
            out.extend(files(&path, ext));
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
    out
}
