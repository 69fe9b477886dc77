//! The local stack, through `scripts/stack.sh`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

/// A running stack in its own directory. It is taken down when the process that started it
/// exits (the script's owner watchdog), or by [`Stack::down`].
pub struct Stack {
    pub dir: PathBuf,
    pub env: BTreeMap<String, String>,
}

/// The repository root (this crate's parent).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

impl Stack {
    /// Starts a fresh stack under `<repo>/.stack-test/<name>-<pid>`, taken down when this
    /// process exits.
    pub fn start(name: &str) -> anyhow::Result<Stack> {
        Stack::start_with(name, "sqlite")
    }

    /// Like [`Stack::start`], with the broker on `storage` (`sqlite` or `memory`).
    pub fn start_with(name: &str, storage: &str) -> anyhow::Result<Stack> {
        let dir = repo_root().join(".stack-test").join(format!("{name}-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).ok();
        }
        Stack::bring_up(&dir, true, storage)
    }

    /// Starts (or reuses) the stack in `dir`, and leaves it running after this process.
    pub fn up(dir: &Path) -> anyhow::Result<Stack> {
        Stack::bring_up(dir, false, "sqlite")
    }

    fn bring_up(dir: &Path, owned: bool, storage: &str) -> anyhow::Result<Stack> {
        let mut command = Command::new(repo_root().join("scripts/stack.sh"));
        command.arg("up").arg(dir).env("SLUICE_BROKER_STORAGE", storage);
        if owned {
            command.env("SLUICE_STACK_OWNER_PID", std::process::id().to_string());
        }
        let status = command.status().context("running scripts/stack.sh")?;
        if !status.success() {
            bail!("scripts/stack.sh up {} failed", dir.display());
        }
        let dir = dir.canonicalize()?;
        let env = read_env(&dir.join("env"))?;
        Ok(Stack { dir, env })
    }

    fn script(&self, verb: &str) -> anyhow::Result<()> {
        let status = Command::new(repo_root().join("scripts/stack.sh"))
            .arg(verb)
            .arg(&self.dir)
            .status()?;
        if !status.success() {
            bail!("scripts/stack.sh {verb} failed");
        }
        Ok(())
    }

    pub fn stop_s3(&self) -> anyhow::Result<()> {
        self.script("stop-s3")
    }
    pub fn start_s3(&self) -> anyhow::Result<()> {
        self.script("start-s3")
    }
    pub fn stop_broker(&self) -> anyhow::Result<()> {
        self.script("stop-broker")
    }
    pub fn start_broker(&self) -> anyhow::Result<()> {
        self.script("start-broker")
    }
    pub fn down(&self) -> anyhow::Result<()> {
        self.script("down")
    }

    pub fn brokers(&self) -> &str {
        &self.env["SLUICE_KAFKA_BROKERS"]
    }

    /// The object store the workers write to.
    pub fn sink(&self) -> anyhow::Result<sluice_worker::sink::Sink> {
        let aws = self
            .env
            .iter()
            .filter(|(k, _)| k.starts_with("AWS_"))
            .map(|(k, v)| (k.clone(), v.clone()));
        Ok(sluice_worker::sink::Sink::from_url_with(&self.env["SLUICE_OUTPUT_URL"], aws)?)
    }

    /// The stack's settings as `(name, value)` pairs, for child processes.
    pub fn vars(&self) -> Vec<(String, String)> {
        self.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

fn read_env(path: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}
