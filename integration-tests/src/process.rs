//! Sluice's binaries as real child processes.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Path of one of Sluice's binaries, built in the same profile as the running test
/// (`make test` builds them first).
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is not built; run `cargo build --release --bins` (make test does)",
        path.display()
    );
    path
}

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// Children die with the process that spawned them (PR_SET_PDEATHSIG) — but the signal follows
/// the *thread* that spawned them. Tests run on short-lived threads, so every child is spawned
/// from one thread that lives as long as the process.
fn keeper() -> &'static mpsc::Sender<SpawnRequest> {
    static KEEPER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();
    KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("child-keeper".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
                // The channel lives in a static: this thread only ends with the process.
                loop {
                    std::thread::park();
                }
            })
            .expect("keeper thread");
        tx
    })
}

/// A running Sluice process.
pub struct Service {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Service {
    /// Starts `binary` with `args` and `env` (on top of a clean environment plus PATH/HOME),
    /// logging to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, binary: &Path, args: &[&str], env: &[(String, String)], log_dir: &Path) -> anyhow::Result<Service> {
        std::fs::create_dir_all(log_dir)?;
        let log = log_dir.join(format!("{name}.log"));
        let out = File::options().create(true).append(true).open(&log)?;
        let mut command = Command::new(binary);
        command
            .args(args)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        for key in ["PATH", "HOME", "RUST_BACKTRACE"] {
            if let Ok(v) = std::env::var(key) {
                command.env(key, v);
            }
        }
        command.envs(device_env());
        command
            .env("SLUICE_LOG_FORMAT", "text")
            .env("RUST_LOG", std::env::var("SLUICE_TEST_LOG").unwrap_or_else(|_| "info".into()));
        command.envs(env.iter().map(|(k, v)| (k, v)));
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let (tx, rx) = mpsc::channel();
        keeper().send((command, tx)).expect("keeper alive");
        let child = rx
            .recv()
            .expect("keeper replies")
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(Service {
            name: name.to_owned(),
            child: Some(child),
            log,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn signal(&self, signal: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill on our own child.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }

    /// SIGKILL, and reap.
    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
    }

    /// SIGTERM, then wait up to `timeout` for a clean exit.
    pub fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        self.signal(libc::SIGTERM);
        self.wait(timeout)
    }

    pub fn signal_hup(&self) {
        self.signal(libc::SIGHUP);
    }

    /// Waits for the process to exit.
    pub fn wait(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().context("already reaped")?;
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("{} did not exit within {timeout:?}", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `GET url` answers 200.
    pub async fn wait_ready(&mut self, url: &str, timeout: Duration) -> anyhow::Result<()> {
        let client = sluice_service::http_client::client();
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(r) = client.get(url).timeout(Duration::from_secs(1)).send().await
                && r.status().is_success()
            {
                return Ok(());
            }
            if !self.running() {
                bail!("{} exited before it was ready; log:\n{}", self.name, tail(&self.log_text(), 3000));
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} not ready at {url} within {timeout:?}; log:\n{}",
                    self.name,
                    tail(&self.log_text(), 3000)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The device settings of the test run, handed to every process it starts (`make gpu-check`
/// runs the suites with `SLUICE_DEVICE=cuda`): the execution provider and its options
/// (`SLUICE_DEVICE`, `SLUICE_REQUIRE_GPU`, `SLUICE_CUDA_*`, `SLUICE_CUDNN_*`), which GPUs
/// (`CUDA_VISIBLE_DEVICES`) and what the CUDA flavour needs to load (`ORT_DYLIB_PATH`,
/// `LD_LIBRARY_PATH`). A worker asked for CUDA is also made to require it, so one that comes up
/// on the CPU fails its test instead of passing it on the wrong device. A test's own settings
/// (`Service::spawn`'s `env`) still win.
pub fn device_env() -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            matches!(
                k.as_str(),
                "SLUICE_DEVICE" | "SLUICE_REQUIRE_GPU" | "CUDA_VISIBLE_DEVICES" | "LD_LIBRARY_PATH"
            ) || k.starts_with("SLUICE_CUDA_")
                || k.starts_with("SLUICE_CUDNN_")
        })
        .collect();
    if on_cuda() {
        if let Ok(dylib) = std::env::var("ORT_DYLIB_PATH") {
            env.push(("ORT_DYLIB_PATH".into(), dylib));
        }
        if !env.iter().any(|(k, _)| k == "SLUICE_REQUIRE_GPU") {
            env.push(("SLUICE_REQUIRE_GPU".into(), "true".into()));
        }
    }
    env
}

/// Whether this test run puts its workers on CUDA (`SLUICE_DEVICE=cuda`, `make gpu-check`).
pub fn on_cuda() -> bool {
    std::env::var("SLUICE_DEVICE").is_ok_and(|d| d == "cuda")
}

/// The end of a text.
pub fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}
