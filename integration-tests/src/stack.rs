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

/// The repository root: this crate's parent as Cargo names it at run time (`cargo test`), else
/// the working directory when it is a Sluice checkout (`make demo`, `make bench`), else where
/// this crate was compiled. (The Cargo target directory is shared between clones, so the
/// compile-time path may be another clone's.)
pub fn repo_root() -> PathBuf {
    let is_root = |p: &Path| p.join("scripts/stack.sh").is_file();
    if let Some(dir) = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from)
        && let Some(root) = dir.parent().filter(|p| is_root(p))
    {
        return root.to_path_buf();
    }
    if let Ok(cwd) = std::env::current_dir()
        && is_root(&cwd)
    {
        return cwd;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

impl Stack {
    /// Starts a fresh stack under `<repo>/.stack-test/<name>-<pid>`, taken down when this
    /// process exits.
    pub fn start(name: &str) -> anyhow::Result<Stack> {
        let dir = repo_root().join(".stack-test").join(format!("{name}-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir).ok();
        }
        Stack::bring_up(&dir, true)
    }

    /// Starts (or reuses) the stack in `dir`, and leaves it running after this process.
    pub fn up(dir: &Path) -> anyhow::Result<Stack> {
        Stack::bring_up(dir, false)
    }

    fn bring_up(dir: &Path, owned: bool) -> anyhow::Result<Stack> {
        let mut command = Command::new(repo_root().join("scripts/stack.sh"));
        command.arg("up").arg(dir);
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
    /// Freezes the S3 server (SIGSTOP): connections are accepted by the kernel and never answered.
    pub fn pause_s3(&self) -> anyhow::Result<()> {
        self.script("pause-s3")
    }
    pub fn resume_s3(&self) -> anyhow::Result<()> {
        self.script("resume-s3")
    }
    pub fn stop_broker(&self) -> anyhow::Result<()> {
        self.script("stop-broker")
    }
    pub fn start_broker(&self) -> anyhow::Result<()> {
        self.script("start-broker")
    }
    /// Kills the broker with SIGKILL: no controlled shutdown, nothing flushed.
    pub fn kill_broker(&self) -> anyhow::Result<()> {
        self.script("kill-broker")
    }
    pub fn down(&self) -> anyhow::Result<()> {
        self.script("down")
    }

    /// A model directory serving the tiny generated model (`scripts/gen-models.py`: the terrain
    /// model's inputs and outputs, ~1 ms per call) as `terrain`: for tests and benchmarks of the
    /// pipeline rather than the model.
    pub fn tiny_models(&self) -> anyhow::Result<PathBuf> {
        let dir = self.dir.join("models-tiny");
        let model = dir.join("terrain/model.onnx");
        if model.exists() {
            return Ok(dir);
        }
        let out = self.dir.join("gen-models");
        let status = Command::new(&self.env["SLUICE_ONNX_PYTHON"])
            .arg(repo_root().join("scripts/gen-models.py"))
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .status()?;
        if !status.success() {
            bail!("generating the tiny model failed");
        }
        std::fs::create_dir_all(dir.join("terrain"))?;
        std::fs::copy(out.join("terrain-tiny/model.onnx"), &model)?;
        Ok(dir)
    }

    /// A fresh set of tasks, completions and DLQ topics named after `scenario`, so that tests
    /// sharing one stack never see each other's records.
    pub fn topics(&self, scenario: &str, task_partitions: u32) -> anyhow::Result<Topics> {
        let topics = Topics {
            tasks: format!("{}.{scenario}", sluice_schemas::topics::TASKS),
            completions: format!("{}.{scenario}", sluice_schemas::topics::COMPLETIONS),
            dlq: format!("{}.{scenario}", sluice_schemas::topics::DLQ),
            ceilings: format!("{}.{scenario}", sluice_schemas::topics::CEILINGS),
            interactive: String::new(),
            batch: String::new(),
        };
        crate::kafka::create_topics(
            self.brokers(),
            &[(&topics.tasks, task_partitions), (&topics.completions, 2), (&topics.dlq, 2)],
        )?;
        crate::kafka::create_compacted_topic(self.brokers(), &topics.ceilings)?;
        Ok(topics)
    }

    /// [`Stack::topics`], and a topic of their own for the interactive and batch lanes, each
    /// with `task_partitions` partitions.
    pub fn lane_topics(&self, scenario: &str, task_partitions: u32) -> anyhow::Result<Topics> {
        let topics = Topics {
            interactive: format!("{}.{scenario}", sluice_schemas::topics::TASKS_INTERACTIVE),
            batch: format!("{}.{scenario}", sluice_schemas::topics::TASKS_BATCH),
            ..self.topics(scenario, task_partitions)?
        };
        crate::kafka::create_topics(
            self.brokers(),
            &[(&topics.interactive, task_partitions), (&topics.batch, task_partitions)],
        )?;
        Ok(topics)
    }

    pub fn brokers(&self) -> &str {
        &self.env["SLUICE_KAFKA_BROKERS"]
    }

    /// The object store the workers write to.
    pub fn sink(&self) -> anyhow::Result<sluice_worker::storage::images::ImageStore> {
        let aws = self
            .env
            .iter()
            .filter(|(k, _)| k.starts_with("AWS_"))
            .map(|(k, v)| (k.clone(), v.clone()));
        Ok(sluice_worker::storage::images::ImageStore::from_url_with(
            &self.env["SLUICE_OUTPUT_URL"],
            aws,
        )?)
    }

    /// The stack's settings as `(name, value)` pairs, for child processes.
    pub fn vars(&self) -> Vec<(String, String)> {
        self.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// The topics one scenario uses.
#[derive(Debug, Clone)]
pub struct Topics {
    pub tasks: String,
    pub completions: String,
    pub dlq: String,
    /// Learned batch ceilings (compacted).
    pub ceilings: String,
    /// The interactive lane's own topic; empty: the lane is in `tasks`.
    pub interactive: String,
    /// The batch lane's own topic; empty: the lane is in `tasks`.
    pub batch: String,
}

impl Default for Topics {
    /// The default topics, those `scripts/stack.sh up` creates.
    fn default() -> Topics {
        Topics {
            tasks: sluice_schemas::topics::TASKS.into(),
            completions: sluice_schemas::topics::COMPLETIONS.into(),
            dlq: sluice_schemas::topics::DLQ.into(),
            ceilings: sluice_schemas::topics::CEILINGS.into(),
            interactive: String::new(),
            batch: String::new(),
        }
    }
}

impl Topics {
    /// Worker settings that point at these topics (the task topics are a producer's too).
    pub fn worker_env(&self) -> [(&'static str, &str); 6] {
        [
            ("SLUICE_TASKS_TOPIC", self.tasks.as_str()),
            ("SLUICE_INTERACTIVE_TOPIC", self.interactive.as_str()),
            ("SLUICE_BATCH_TOPIC", self.batch.as_str()),
            ("SLUICE_COMPLETIONS_TOPIC", self.completions.as_str()),
            ("SLUICE_DLQ_TOPIC", self.dlq.as_str()),
            ("SLUICE_CEILINGS_TOPIC", self.ceilings.as_str()),
        ]
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
