//! The harness of Sluice's end-to-end tests, demo and benchmarks: the local stack started through
//! the same scripts users run, Sluice's own binaries as real processes, and clients for the
//! topics, the HTTP API and the object store. Nothing here is a fake.

pub mod cluster;
pub mod contact;
#[cfg(test)]
mod import_cycles;
pub mod inprocess;
pub mod kafka;
#[cfg(test)]
mod manual;
#[cfg(test)]
mod module_map;
pub mod process;
pub mod receiver;
pub mod records;
pub mod rejected;
pub mod reload_memory;
#[cfg(test)]
mod repo_files;
pub mod stack;

pub use kafka::{Consumed, TopicReader, produce_raw};
pub use process::{Service, bin};
pub use records::{
    Outcomes, completions_for, demo_catalog, diffusion_task, ids_of, publish_tasks, publish_to_partition, sd_task, terrain_task,
};
pub use rejected::{names_field, rejected_fields};
pub use reload_memory::{ReloadRss, assert_rss_bounded};
pub use stack::{Stack, Topics};

use std::time::{Duration, Instant};

/// Polls `check` until it returns `Some`, or fails after `timeout`.
pub async fn wait_for<T>(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> Option<T>) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A free TCP port on the loopback interface.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Decodes a PNG: (width, height, colour type, bit depth).
pub fn png_info(bytes: &[u8]) -> anyhow::Result<(u32, u32, png::ColorType, png::BitDepth)> {
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info()?;
    let mut buf = vec![0; reader.output_buffer_size().ok_or_else(|| anyhow::anyhow!("image too large"))?];
    let info = reader.next_frame(&mut buf)?;
    Ok((info.width, info.height, info.color_type, info.bit_depth))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// Decodes an 8-bit PNG to its samples (RGB interleaved for RGB images).
pub fn png_pixels(bytes: &[u8]) -> anyhow::Result<(u32, u32, Vec<u8>)> {
    let mut reader = png::Decoder::new(std::io::Cursor::new(bytes)).read_info()?;
    let mut buf = vec![0; reader.output_buffer_size().ok_or_else(|| anyhow::anyhow!("image too large"))?];
    let info = reader.next_frame(&mut buf)?;
    buf.truncate(info.buffer_size());
    Ok((info.width, info.height, buf))
}

/// A tool `scripts/install-tools.sh` installed (`~/.cache/sluice/tools/<name-version>/<path>`),
/// failing with how to install it when it is missing.
pub fn tool(dir: &str, path: &str) -> std::path::PathBuf {
    let cache = std::env::var("SLUICE_CACHE").unwrap_or_else(|_| format!("{}/.cache/sluice", std::env::var("HOME").unwrap_or_default()));
    let found = std::path::Path::new(&cache).join("tools").join(dir).join(path);
    assert!(found.exists(), "{} missing: run scripts/install-tools.sh", found.display());
    found
}

/// The runtime assets (`scripts/fetch-assets.sh`, idempotent): `ORT_DYLIB_PATH`,
/// `SLUICE_SD_TINY` (the tiny Stable Diffusion models), ….
pub fn assets() -> anyhow::Result<std::collections::BTreeMap<String, String>> {
    static ASSETS: std::sync::OnceLock<std::collections::BTreeMap<String, String>> = std::sync::OnceLock::new();
    if let Some(a) = ASSETS.get() {
        return Ok(a.clone());
    }
    let out = std::process::Command::new(stack::repo_root().join("scripts/fetch-assets.sh")).output()?;
    if !out.status.success() {
        anyhow::bail!("fetch-assets.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let map = String::from_utf8(out.stdout)?
        .lines()
        .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    Ok(ASSETS.get_or_init(|| map).clone())
}
