//! A whole Sluice deployment on the local stack: the producer and a group of workers.

use std::time::Duration;

use anyhow::Context;
use serde_json::Value;

use crate::free_port;
use crate::process::{Service, bin, on_cuda};
use crate::stack::{Stack, Topics};

/// The API key the test producer accepts, for tenant `acme`.
pub const API_KEY: &str = "test-key";
/// The API key of a second tenant, `rival`.
pub const RIVAL_KEY: &str = "rival-key";
/// The workers' `SLUICE_ADMIN_TOKEN` (a test sets it empty to turn admin off).
pub const ADMIN_TOKEN: &str = "test-admin-token";

pub struct Cluster {
    pub stack: Stack,
    pub producer: Service,
    pub producer_url: String,
    /// The producer's metrics listener.
    pub producer_metrics_url: String,
    pub workers: Vec<Worker>,
    producer_env: Vec<(String, String)>,
}

pub struct Worker {
    pub service: Service,
    pub url: String,
    pub id: String,
    env: Vec<(String, String)>,
}

impl Worker {
    /// Starts a worker on `stack` with extra settings.
    pub async fn start(stack: &Stack, id: &str, extra: &[(&str, &str)]) -> anyhow::Result<Worker> {
        let port = free_port();
        let mut env = stack.vars();
        env.push(("SLUICE_LISTEN".into(), format!("127.0.0.1:{port}")));
        env.push(("SLUICE_WORKER_ID".into(), id.into()));
        env.push(("SLUICE_ADMIN_TOKEN".into(), ADMIN_TOKEN.into()));
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let mut service = Service::spawn(id, &bin("sluice-worker"), &[], &env, &stack.dir.join("logs"))?;
        let url = format!("http://127.0.0.1:{port}");
        service.wait_ready(&format!("{url}/readyz"), Duration::from_secs(60)).await?;
        check_device(&service)?;
        Ok(Worker {
            service,
            url,
            id: id.into(),
            env,
        })
    }

    /// Starts a worker `id` in group `group` on `topics`, with extra settings.
    pub async fn on_topics(stack: &Stack, id: &str, group: &str, topics: &Topics, extra: &[(&str, &str)]) -> anyhow::Result<Worker> {
        let mut env: Vec<(&str, &str)> = topics.worker_env().to_vec();
        env.push(("SLUICE_GROUP_ID", group));
        env.extend_from_slice(extra);
        Worker::start(stack, id, &env).await
    }

    /// Starts this worker again after it stopped (same id, same settings, new port).
    pub async fn restart(&mut self, stack: &Stack) -> anyhow::Result<()> {
        let port = free_port();
        for (k, v) in self.env.iter_mut() {
            if k == "SLUICE_LISTEN" {
                *v = format!("127.0.0.1:{port}");
            }
        }
        self.service = Service::spawn(&self.id, &bin("sluice-worker"), &[], &self.env, &stack.dir.join("logs"))?;
        self.url = format!("http://127.0.0.1:{port}");
        self.service
            .wait_ready(&format!("{}/readyz", self.url), Duration::from_secs(60))
            .await?;
        check_device(&self.service)
    }

    /// Waits until the worker owns partitions (its group has settled with it in).
    pub async fn wait_assigned(&self, timeout: Duration) -> anyhow::Result<()> {
        crate::wait_for(&format!("{} to be assigned partitions", self.id), timeout, async || {
            self.metric("sluice_worker_assigned_partitions").await.filter(|n| *n > 0.0)
        })
        .await
        .map(|_| ())
    }

    /// `POST /admin/reload` with the admin token: the status and the JSON body.
    pub async fn reload(&self, body: &Value) -> (u16, Value) {
        let response = sluice_service::http_client::client()
            .post(format!("{}/admin/reload", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .json(body)
            .send()
            .await
            .expect("POST /admin/reload");
        (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
    }

    /// The worker's `/metrics` text.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(sluice_service::http_client::client()
            .get(format!("{}/metrics", self.url))
            .send()
            .await?
            .text()
            .await?)
    }

    /// The value of a metric line (`name{labels}` exactly as exposed), if present.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        metric_value(&self.metrics().await.ok()?, series)
    }
}

/// `POST /v1/tasks` to the producer at `url` with any key (or none): the status and the JSON
/// body (null when there is none).
pub async fn post_task(url: &str, body: &Value, key: Option<&str>) -> anyhow::Result<(u16, Value)> {
    // A client per call: tests share one cluster across their own runtimes.
    let mut request = sluice_service::http_client::client().post(format!("{url}/v1/tasks")).json(body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    Ok((status, response.json().await.unwrap_or(Value::Null)))
}

/// A producer of its own on `stack`, beside any cluster's: tenant `acme` with [`API_KEY`],
/// webhooks off, its status view at `store`, `extra` settings last; ready on `/readyz` (its view
/// caught up). Returns it and its API's URL.
pub async fn lone_producer(
    stack: &Stack,
    name: &str,
    store: &std::path::Path,
    extra: &[(&str, &str)],
) -> anyhow::Result<(Service, String)> {
    let port = free_port();
    let mut env = stack.vars();
    env.push(("SLUICE_LISTEN".into(), format!("127.0.0.1:{port}")));
    env.push(("SLUICE_METRICS_LISTEN".into(), format!("127.0.0.1:{}", free_port())));
    env.push(("SLUICE_STATUS_PATH".into(), store.display().to_string()));
    env.push(("SLUICE_API_KEYS".into(), format!("acme:{API_KEY}")));
    env.push(("SLUICE_WEBHOOKS".into(), "false".into()));
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let mut producer = Service::spawn(name, &bin("sluice-producer"), &["serve"], &env, &stack.dir.join("logs"))?;
    let url = format!("http://127.0.0.1:{port}");
    producer.wait_ready(&format!("{url}/readyz"), Duration::from_secs(60)).await?;
    Ok((producer, url))
}

/// Every model a ready worker loaded is on the device this test run asked for (`SLUICE_DEVICE`:
/// `make gpu-check` runs the suites on CUDA, everything else on the CPU), as its `model loaded`
/// log lines say: a worker meant for the GPU that came up on the CPU fails here, loudly.
fn check_device(service: &Service) -> anyhow::Result<()> {
    let want = if on_cuda() { "cuda" } else { "cpu" };
    let log = service.log_text();
    let placements: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("model loaded"))
        .filter_map(|l| {
            let (_, rest) = l.split_once("placement=").or_else(|| l.split_once("\"placement\":\""))?;
            rest.split([' ', '"', ',']).next()
        })
        .collect();
    anyhow::ensure!(!placements.is_empty(), "{}: no `model loaded` line names a placement", service.name);
    for placement in placements {
        anyhow::ensure!(
            placement.starts_with(want),
            "{}: a model loaded on {placement}, but this run asked for {want} (SLUICE_DEVICE)",
            service.name
        );
    }
    Ok(())
}

/// GET `url` without credentials (health, metrics, the model list, presigned objects); panics
/// naming the URL if the request cannot be sent.
pub async fn http_get(url: &str) -> reqwest::Response {
    sluice_service::http_client::client()
        .get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
}

/// `GET` with an API key: the status and the JSON body (null when there is none).
pub async fn get_json(url: &str, key: &str) -> (u16, Value) {
    let response = sluice_service::http_client::client()
        .get(url)
        .bearer_auth(key)
        .send()
        .await
        .expect("GET");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The value of `series` in a Prometheus text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// The sum of every series of metric `name` (all label values) in a Prometheus text exposition.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    series_sum(text, &format!("{name}{{"))
}

/// The sum of every series whose line starts with `prefix` (a metric's name and the start of its
/// labels, e.g. `name{bucket="sd-tiny:`) in a Prometheus text exposition.
pub fn series_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |sum, n| sum + n)
}

/// The `q` quantile of histogram `name` in a Prometheus text exposition, interpolated within
/// its bucket as `histogram_quantile` does; `None` without observations.
pub fn histogram_quantile(text: &str, name: &str, q: f64) -> Option<f64> {
    let prefix = format!("{name}_bucket{{le=\"");
    let buckets: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, count.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.last()?.1;
    if total == 0.0 {
        return None;
    }
    let rank = q * total;
    let mut previous = (0.0, 0.0);
    for (le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(previous.0);
            }
            let within = if count > previous.1 {
                (rank - previous.1) / (count - previous.1)
            } else {
                1.0
            };
            return Some(previous.0 + (le - previous.0) * within);
        }
        previous = (le, count);
    }
    None
}

impl Cluster {
    /// A stack, a producer with API keys, and `workers` workers in one group.
    pub async fn start(name: &str, workers: usize, worker_env: &[(&str, &str)]) -> anyhow::Result<Cluster> {
        Cluster::start_with(name, workers, worker_env, &[]).await
    }

    /// Like [`Cluster::start`], with settings for every service (the producer too).
    pub async fn start_with(name: &str, workers: usize, worker_env: &[(&str, &str)], common: &[(&str, &str)]) -> anyhow::Result<Cluster> {
        let stack = Stack::start(name)?;
        let (port, metrics_port) = (free_port(), free_port());
        let mut env = stack.vars();
        env.extend(common.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env.push(("SLUICE_LISTEN".into(), format!("127.0.0.1:{port}")));
        env.push(("SLUICE_METRICS_LISTEN".into(), format!("127.0.0.1:{metrics_port}")));
        env.push(("SLUICE_API_KEYS".into(), format!("acme:{API_KEY},rival:{RIVAL_KEY}")));
        env.push((
            "SLUICE_STATUS_PATH".into(),
            stack.dir.join("status/view.redb").display().to_string(),
        ));
        let mut producer = Service::spawn("producer", &bin("sluice-producer"), &["serve"], &env, &stack.dir.join("logs"))?;
        let producer_url = format!("http://127.0.0.1:{port}");
        producer
            .wait_ready(&format!("{producer_url}/healthz"), Duration::from_secs(30))
            .await?;
        let mut started = Vec::new();
        let worker_env: Vec<(&str, &str)> = common.iter().chain(worker_env).copied().collect();
        for i in 0..workers {
            started.push(
                Worker::start(&stack, &format!("worker-{i}"), &worker_env)
                    .await
                    .with_context(|| format!("starting worker-{i}"))?,
            );
        }
        // Tests expect the work to be shared: wait until the group has settled, every worker
        // owning partitions (the first one to start holds them all until the others join).
        for w in &started {
            w.wait_assigned(Duration::from_secs(90)).await?;
        }
        Ok(Cluster {
            stack,
            producer,
            producer_url,
            producer_metrics_url: format!("http://127.0.0.1:{metrics_port}"),
            workers: started,
            producer_env: env,
        })
    }

    /// Kills the producer (SIGKILL) and starts it again with the same settings and address;
    /// returns once it answers.
    pub async fn kill_and_restart_producer(&mut self) -> anyhow::Result<()> {
        self.producer.kill9();
        self.producer = Service::spawn(
            "producer",
            &bin("sluice-producer"),
            &["serve"],
            &self.producer_env,
            &self.stack.dir.join("logs"),
        )?;
        self.producer
            .wait_ready(&format!("{}/healthz", self.producer_url), Duration::from_secs(30))
            .await
    }

    /// Polls `GET /v1/tasks/{id}` with `key` until the task's status is `status`; returns that
    /// body.
    pub async fn wait_for_status(&self, id: &str, key: &str, status: &str, timeout: Duration) -> anyhow::Result<Value> {
        let url = format!("{}/v1/tasks/{id}", self.producer_url);
        crate::wait_for(&format!("task {id} to be {status} in the status view"), timeout, async || {
            let (_, body) = get_json(&url, key).await;
            (body["status"] == status).then_some(body)
        })
        .await
    }

    /// The producer's `/metrics` text.
    pub async fn producer_metrics(&self) -> anyhow::Result<String> {
        Ok(sluice_service::http_client::client()
            .get(format!("{}/metrics", self.producer_metrics_url))
            .send()
            .await?
            .text()
            .await?)
    }

    /// `POST /v1/tasks` with the test key; returns the status and the JSON body.
    pub async fn submit(&self, body: &Value) -> anyhow::Result<(u16, Value)> {
        self.post(body, Some(API_KEY)).await
    }

    /// `POST /v1/tasks` with any key (or none).
    pub async fn post(&self, body: &Value, key: Option<&str>) -> anyhow::Result<(u16, Value)> {
        post_task(&self.producer_url, body, key).await
    }

    /// Submits and returns the task id, failing unless the producer answered 202.
    pub async fn submit_ok(&self, body: &Value) -> anyhow::Result<String> {
        let (status, reply) = self.submit(body).await?;
        anyhow::ensure!(status == 202, "expected 202, got {status}: {reply}");
        Ok(reply["task_id"].as_str().context("task_id")?.to_owned())
    }
}

/// Runs `sluice-producer` with `args` against `stack` to the end; returns its stdout, failing
/// with its stderr when it exits non-zero.
pub fn producer_cli(stack: &Stack, args: &[&str]) -> anyhow::Result<String> {
    let output = std::process::Command::new(bin("sluice-producer"))
        .args(args)
        .envs(stack.vars())
        .env("SLUICE_LOG_FORMAT", "text")
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "sluice-producer {args:?} failed ({}): {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}
