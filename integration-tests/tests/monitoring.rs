//! Observability against real receivers: the chart's alerts and dashboard on a real Prometheus
//! server (Debian's `prometheus` package, fetched by `scripts/install-tools.sh`) scraping a real
//! producer and worker; spans exported over OTLP/HTTP to a receiver that decodes them with
//! OpenTelemetry's own protobuf definitions (`scripts/otlp-receiver.py`).
//!
//! The rules are `helm/sluice/files/alerts.yaml` as the chart ships them, with one change: every
//! `for:` is cut to 5 s, so that a test does not wait 15 minutes. Expressions and thresholds are
//! the chart's (the backlog alert needs more than 1,000 waiting tasks: the test submits 1,200).

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sluice_integration_tests::cluster::{API_KEY, Cluster, Worker, http_get};
use sluice_integration_tests::kafka::{produce_raw, producer};
use sluice_integration_tests::process::Service;
use sluice_integration_tests::receiver::Receiver;
use sluice_integration_tests::stack::repo_root;
use sluice_integration_tests::{free_port, wait_for};

const WEBHOOK_KEY: &[u8] = b"sluice-monitoring-webhook-secret";
const TASKS: usize = 1_200;

fn prometheus_binary() -> PathBuf {
    sluice_integration_tests::tool("prometheus-2.42.0+ds-5+deb12u1", "usr/bin/prometheus")
}

/// The chart's rules with every `for:` cut to 5 s.
fn rules_for_test() -> String {
    let text = std::fs::read_to_string(repo_root().join("helm/sluice/files/alerts.yaml")).unwrap();
    let mut waits = 0;
    let lines: Vec<String> = text
        .lines()
        .map(|line| match line.trim_start().strip_prefix("for: ") {
            Some(_) => {
                waits += 1;
                format!("{}for: 5s", &line[..line.len() - line.trim_start().len()])
            }
            None => line.to_owned(),
        })
        .collect();
    assert!(waits >= 5, "the rules have their waiting times");
    lines.join("\n") + "\n"
}

/// Prometheus scraping the producer and the workers listed in a file it watches (workers that
/// restart come back on other ports).
struct Prometheus {
    _service: Service,
    url: String,
    targets: PathBuf,
}

impl Prometheus {
    async fn start(dir: &Path, producer: &str, workers: &[&str]) -> Prometheus {
        let dir = dir.join("prometheus");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("rules.yaml"), rules_for_test()).unwrap();
        let targets = dir.join("workers.json");
        // JSON is YAML: Prometheus reads this configuration as it is.
        let config = json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [
                {"job_name": "sluice-producer", "static_configs": [{"targets": [producer]}]},
                {"job_name": "sluice-worker", "file_sd_configs": [{"files": [targets.display().to_string()], "refresh_interval": "1s"}]},
            ],
        });
        std::fs::write(dir.join("prometheus.yml"), config.to_string()).unwrap();
        let port = free_port();
        let args = [
            format!("--config.file={}", dir.join("prometheus.yml").display()),
            format!("--storage.tsdb.path={}", dir.join("data").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut service = Service::spawn("prometheus", &prometheus_binary(), &args, &[], &dir).unwrap();
        let url = format!("http://127.0.0.1:{port}");
        service
            .wait_ready(&format!("{url}/-/ready"), Duration::from_secs(60))
            .await
            .unwrap();
        let prometheus = Prometheus {
            _service: service,
            url,
            targets,
        };
        prometheus.scrape_workers(workers);
        prometheus
    }

    fn scrape_workers(&self, workers: &[&str]) {
        let partial = self.targets.with_extension("partial");
        std::fs::write(&partial, json!([{"targets": workers}]).to_string()).unwrap();
        std::fs::rename(partial, &self.targets).unwrap();
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.url), query).unwrap();
        let reply: Value = http_get(url.as_str()).await.json().await.unwrap();
        assert_eq!(reply["status"], "success", "{path} {query:?}: {reply}");
        reply["data"].clone()
    }

    /// Alert name → state (`pending` or `firing`) of the alerts active now.
    async fn alerts(&self) -> Vec<(String, String)> {
        let data = self.api("/api/v1/alerts", &[]).await;
        data["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap().to_owned(),
                    a["state"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    async fn firing(&self, name: &str) -> bool {
        self.alerts().await.iter().any(|(n, s)| n == name && s == "firing")
    }
}

/// Stop the only worker while tasks arrive: the producer's backlog measurement crosses the chart's
/// threshold and Prometheus fires the backlog and stuck-consumer alerts; start the worker: they
/// resolve. Every rule evaluates without error, and every expression of the dashboard evaluates
/// and (but for the handled-OOM panel: no OOM happens here) returns data after the load.
#[tokio::test(flavor = "multi_thread")]
async fn backlog_alerts_fire_with_no_worker_up_and_resolve_on_a_real_prometheus_and_the_dashboard_has_data() {
    let secret = format!("acme:whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY));
    let c = Cluster::start_with(
        "monitoring",
        0,
        &[],
        &[
            ("SLUICE_BACKLOG_INTERVAL_MS", "1000"),
            ("SLUICE_WEBHOOK_SECRETS", secret.as_str()),
            ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.1/32"),
        ],
    )
    .await
    .expect("cluster starts");
    // The ~1 ms generated model: the load is about the pipeline, not about inference.
    let models = c.stack.tiny_models().unwrap().display().to_string();
    let mut worker = Worker::start(&c.stack, "worker-0", &[("SLUICE_MODEL_DIR", models.as_str())])
        .await
        .unwrap();
    worker.wait_assigned(Duration::from_secs(90)).await.unwrap();
    let address = |url: &str| url.trim_start_matches("http://").to_owned();
    let prometheus = Prometheus::start(&c.stack.dir, &address(&c.producer_metrics_url), &[&address(&worker.url)]).await;
    wait_for("a first worker scrape", Duration::from_secs(30), async || {
        let up = prometheus
            .api("/api/v1/query", &[("query", "up{job=\"sluice-worker\"} == 1")])
            .await;
        (!up["result"].as_array().unwrap().is_empty()).then_some(())
    })
    .await
    .unwrap();

    // No worker: tasks arrive and wait.
    worker.service.terminate(Duration::from_secs(30)).unwrap();
    let requests: String = (0..TASKS)
        .map(|i| json!({"model": "terrain", "seed": i, "width": 64, "height": 64}).to_string() + "\n")
        .collect();
    let file = c.stack.dir.join("monitoring-tasks.jsonl");
    std::fs::write(&file, requests).unwrap();
    sluice_integration_tests::cluster::producer_cli(&c.stack, &["submit", &file.display().to_string()]).unwrap();
    // A record no worker can read (a DLQ reason on the dashboard) and a task with a webhook.
    let kafka = producer(c.stack.brokers()).unwrap();
    produce_raw(&kafka, sluice_schemas::topics::TASKS, Some(b"junk"), b"{not json", &[])
        .await
        .unwrap();
    let (receiver, base) = Receiver::start().await;
    let (status, _) = c
        .post(
            &json!({"model": "terrain", "width": 64, "height": 64, "webhook": {"url": format!("{base}/hook/ok")}}),
            Some(API_KEY),
        )
        .await
        .unwrap();
    assert_eq!(status, 202);

    for alert in ["SluiceBacklogGrowing", "SluiceConsumerStuck"] {
        wait_for(&format!("{alert} to fire"), Duration::from_secs(120), async || {
            prometheus.firing(alert).await.then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    let backlog = prometheus
        .api(
            "/api/v1/query",
            &[("query", "sum(max by (topic, partition) (sluice_producer_backlog_tasks))")],
        )
        .await;
    let waiting: f64 = backlog["result"][0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!(waiting > 1000.0, "{backlog}");

    // A worker again (Prometheus scrapes it at its new address): the backlog drains, both resolve.
    worker.restart(&c.stack).await.unwrap();
    prometheus.scrape_workers(&[&address(&worker.url)]);
    let drained = wait_for(
        "the backlog to drain and the alerts to resolve",
        Duration::from_secs(240),
        async || {
            let active = prometheus.alerts().await;
            let drained = prometheus
                .api(
                    "/api/v1/query",
                    &[("query", "sum(max by (topic, partition) (sluice_producer_backlog_tasks)) == 0")],
                )
                .await;
            let quiet = !active
                .iter()
                .any(|(n, _)| n == "SluiceBacklogGrowing" || n == "SluiceConsumerStuck");
            (quiet && !drained["result"].as_array().unwrap().is_empty()).then_some(())
        },
    )
    .await;
    if let Err(e) = drained {
        let backlog = prometheus.api("/api/v1/query", &[("query", "sluice_producer_backlog_tasks")]).await;
        panic!("{e}: alerts {:?}, backlog {backlog}", prometheus.alerts().await);
    }
    wait_for("the webhook", Duration::from_secs(60), async || {
        (!receiver.all().is_empty()).then_some(())
    })
    .await
    .unwrap();
    // A few more scrapes, so that rates over the load have their points.
    tokio::time::sleep(Duration::from_secs(5)).await;

    let rules = prometheus.api("/api/v1/rules", &[]).await;
    let mut evaluated = 0;
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            assert_eq!(rule["health"], "ok", "{rule}");
            evaluated += 1;
        }
    }
    assert!(evaluated >= 12, "{rules}");

    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(repo_root().join("helm/sluice/files/dashboard.json")).unwrap()).unwrap();
    let mut empty = Vec::new();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap().replace("$__rate_interval", "1m");
            let data = prometheus.api("/api/v1/query", &[("query", &expr)]).await;
            checked += 1;
            // Out-of-memory errors and clean-arena retries only happen under a memory cap, joins
            // only to a diffusion batch that runs step by step (this load is terrain).
            let conditional = [
                "sluice_worker_oom_total",
                "sluice_worker_clean_arena_retries_total",
                "sluice_worker_tasks_joined_total",
            ];
            if data["result"].as_array().unwrap().is_empty() && !conditional.iter().any(|m| expr.contains(m)) {
                empty.push(expr);
            }
        }
    }
    assert!(checked >= 20);
    assert!(empty.is_empty(), "dashboard expressions without data after the load: {empty:#?}");
    c.stack.down().unwrap();
}

/// With `OTEL_EXPORTER_OTLP_ENDPOINT` set, a request's trace arrives at an OTLP/HTTP receiver as
/// one trace: the request's span → the producer's `send` span → the worker's `process` span, whose
/// id the completion record's `traceparent` carries; attributes per OpenTelemetry's messaging
/// conventions for Kafka.
#[tokio::test(flavor = "multi_thread")]
async fn one_trace_spans_the_request_the_producer_the_worker_and_the_completion_over_otlp() {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("sluice-otlp-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    let spans_file = dir.join("spans.jsonl");
    let receiver_args = [
        repo_root().join("scripts/otlp-receiver.py").display().to_string(),
        port.to_string(),
        spans_file.display().to_string(),
    ];
    let receiver_args: Vec<&str> = receiver_args.iter().map(String::as_str).collect();
    let _receiver = Service::spawn(
        "otlp-receiver",
        &sluice_integration_tests::tool("otlp-proto-1.45.2", "bin/python"),
        &receiver_args,
        &[],
        &dir,
    )
    .unwrap();
    let endpoint = format!("http://127.0.0.1:{port}");
    wait_for("the OTLP receiver", Duration::from_secs(30), async || {
        sluice_service::http_client::client()
            .get(format!("{endpoint}/"))
            .send()
            .await
            .ok()
            .map(|_| ())
    })
    .await
    .unwrap();
    let c = Cluster::start_with(
        "otlp",
        0,
        &[],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ],
    )
    .await
    .expect("cluster starts");
    let models = c.stack.tiny_models().unwrap().display().to_string();
    let worker_env = [
        ("SLUICE_MODEL_DIR", models.as_str()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
    ];
    let worker = Worker::start(&c.stack, "worker-0", &worker_env).await.unwrap();
    worker.wait_assigned(Duration::from_secs(90)).await.unwrap();

    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let request_span = "b7ad6b7169203331";
    let response = sluice_service::http_client::client()
        .post(format!("{}/v1/tasks", c.producer_url))
        .bearer_auth(API_KEY)
        .header("traceparent", format!("00-{trace_id}-{request_span}-01"))
        .json(&json!({"model": "terrain", "width": 64, "height": 64}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let id = response.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned();
    sluice_integration_tests::completions_for(
        c.stack.brokers(),
        &std::collections::BTreeSet::from([id.clone()]),
        Duration::from_secs(60),
    );

    let spans = wait_for("the producer's and the worker's spans", Duration::from_secs(30), async || {
        let text = std::fs::read_to_string(&spans_file).unwrap_or_default();
        let spans: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let ours: Vec<Value> = spans.into_iter().filter(|s| s["trace_id"] == trace_id).collect();
        (ours.len() >= 2).then_some(ours)
    })
    .await
    .unwrap();
    let find = |name: &str| {
        spans
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
    };
    let send = find("send sluice.tasks.v1");
    let process = find("process sluice.tasks.v1");
    assert_eq!(spans.len(), 2, "{spans:#?}");
    assert_eq!(
        (&send["service"], &send["kind"]),
        (&json!("sluice-producer"), &json!("SPAN_KIND_PRODUCER"))
    );
    assert_eq!(
        (&process["service"], &process["kind"]),
        (&json!("sluice-worker"), &json!("SPAN_KIND_CONSUMER"))
    );
    assert_eq!(send["parent_span_id"], request_span, "the producer continues the request's span");
    assert_eq!(
        process["parent_span_id"], send["span_id"],
        "the worker's span is a child of the producer's"
    );
    assert!(send["start"].as_u64() <= process["start"].as_u64() && process["start"].as_u64() <= process["end"].as_u64());

    // The records carry the same spans: the task record the producer's, the completion the worker's.
    let header_of = |topic: &str| -> String {
        let values = sluice_integration_tests::kafka::header_values(c.stack.brokers(), topic, &id, "traceparent").unwrap();
        values.into_iter().next().unwrap()
    };
    assert_eq!(
        header_of(sluice_schemas::topics::TASKS),
        format!("00-{trace_id}-{}-01", send["span_id"].as_str().unwrap())
    );
    assert_eq!(
        header_of(sluice_schemas::topics::COMPLETIONS),
        format!("00-{trace_id}-{}-01", process["span_id"].as_str().unwrap())
    );

    // OpenTelemetry's messaging conventions for Kafka.
    let (sa, pa) = (&send["attributes"], &process["attributes"]);
    for a in [sa, pa] {
        assert_eq!(a["messaging.system"], "kafka");
        assert_eq!(a["messaging.destination.name"], sluice_schemas::topics::TASKS);
        assert_eq!(a["messaging.kafka.message.key"], id.as_str());
        assert_eq!(a["messaging.kafka.offset"], pa["messaging.kafka.offset"], "the same record");
        assert_eq!(a["messaging.destination.partition.id"], pa["messaging.destination.partition.id"]);
    }
    assert_eq!(
        (&sa["messaging.operation.type"], &pa["messaging.operation.type"]),
        (&json!("send"), &json!("process"))
    );
    assert_eq!(pa["messaging.consumer.group.name"], "sluice-workers");
    assert_eq!(pa["sluice.task.status"], "succeeded");
    let offset: i64 = pa["messaging.kafka.offset"].as_str().unwrap().parse().unwrap();
    assert!(offset >= 0);

    // Logs carry the trace id (JSON in production; the tests run with text logs).
    let log = std::fs::read_to_string(c.stack.dir.join("logs/producer.log")).unwrap();
    assert!(
        log.lines().any(|l| l.contains("task accepted") && l.contains(trace_id)),
        "the producer's accept log"
    );
    drop(worker);
    c.stack.down().unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
