//! `sluice-producer`: see the crate documentation.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use sluice_schemas::Catalog;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use rdkafka::producer::{FutureProducer, Producer};
use sluice_producer::config::{Cli, Command, PublishArgs, RangeArgs, ServeArgs, SubmitArgs};
use sluice_producer::metrics::Metrics;
use sluice_producer::publish::{Submitter, TaskPublisher};
use sluice_producer::replay::{self, Bounds, Filter, Mode};
use sluice_service::{shutdown, telemetry};
use tokio::io::AsyncBufReadExt;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    let result = match cli.command {
        Command::Serve(args) => serve(*args).await,
        Command::Submit(args) => submit(args).await,
        Command::Replay(args) => {
            let filter = Filter {
                models: args.model,
                tenants: args.tenant,
                ..Filter::default()
            };
            let source = args.source_topic.unwrap_or_else(|| args.publish.tasks_topic.clone());
            copy_range(Mode::Replay, &args.publish, &args.range, &source, &filter).await
        }
        Command::Redrive(args) => {
            let filter = Filter {
                reasons: args.reason,
                ..Filter::default()
            };
            copy_range(Mode::Redrive, &args.publish, &args.range, &args.dlq_topic, &filter).await
        }
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "sluice-producer failed");
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// `serve`: OTLP export when configured, the service until SIGTERM or SIGINT, then whatever
/// spans are left exported.
async fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    sluice_service::otlp::init("sluice-producer")?;
    sluice_producer::serve(args, shutdown::terminated()).await?;
    sluice_service::otlp::flush(Duration::from_secs(5)).await;
    Ok(ExitCode::SUCCESS)
}

/// Publishes each line of a JSON-lines file; prints `task_id` per accepted line, and a line
/// number with the reason per rejected one. Exits non-zero if any line was rejected.
async fn submit(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let metrics = Metrics::new();
    let publisher = TaskPublisher::connect(&args.publish, &metrics).context("creating the Kafka producer")?;
    // A producer's metadata requests may create a topic that does not exist (the broker's
    // auto-creation): one the workers do not read would hold the tasks for good.
    tokio::task::block_in_place(|| publisher.check_topics())?;
    let catalog = Arc::new(Catalog::load(args.publish.model_catalog.as_deref())?);
    let timeout = Duration::from_millis(args.publish.publish_timeout_ms);
    let reader: Box<dyn tokio::io::AsyncRead + Unpin> = if args.input == Path::new("-") {
        Box::new(tokio::io::stdin())
    } else {
        Box::new(
            tokio::fs::File::open(&args.input)
                .await
                .with_context(|| format!("opening {}", args.input.display()))?,
        )
    };
    let mut lines = tokio::io::BufReader::new(reader).lines();
    let mut numbered = Vec::new();
    let mut n = 0usize;
    while let Some(line) = lines.next_line().await? {
        n += 1;
        if !line.trim().is_empty() {
            numbered.push((n, line));
        }
    }
    let submitter = Submitter {
        tenant: args.tenant.clone(),
        user: None,
    };
    let results: Vec<(usize, Result<String, String>)> = futures::stream::iter(numbered)
        .map(|(n, line)| {
            let (publisher, submitter, catalog) = (publisher.clone(), submitter.clone(), catalog.clone());
            async move {
                let result = async {
                    let value: serde_json::Value = serde_json::from_str(&line).map_err(|e| format!("not JSON: {e}"))?;
                    let record = TaskPublisher::record(&catalog, &value, &submitter).map_err(|e| e.to_string())?;
                    publisher.publish(&record, timeout).await.map_err(|e| e.to_string())?;
                    Ok(record.task_id.to_string())
                }
                .await;
                (n, result)
            }
        })
        .buffered(args.concurrency.max(1))
        .collect()
        .await;
    let mut failed = 0;
    for (n, result) in results {
        match result {
            Ok(id) => println!("{id}"),
            Err(e) => {
                failed += 1;
                eprintln!("line {n}: {e}");
            }
        }
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Replay or redrive: resolves the range, copies it with a progress bar, prints a JSON summary
/// on stdout.
async fn copy_range(mode: Mode, publish: &PublishArgs, range: &RangeArgs, source: &str, filter: &Filter) -> anyhow::Result<ExitCode> {
    let consumer: rdkafka::consumer::BaseConsumer = publish
        .kafka
        .config(&[
            ("group.id", &format!("sluice-replay-{}", uuid::Uuid::new_v4())),
            ("enable.auto.commit", "false"),
            // A DLQ record of an aborted worker transaction was never a verdict: not redriven.
            ("isolation.level", "read_committed"),
            ("enable.partition.eof", "false"),
            ("fetch.wait.max.ms", "100"),
        ])
        .create()
        .context("creating the Kafka consumer")?;
    let bounds = Bounds {
        partitions: range.partition.clone(),
        from_offsets: range.from_offset.iter().copied().collect(),
        to_offsets: range.to_offset.iter().copied().collect(),
        since: range.since,
        until: range.until,
    };
    let timeout = Duration::from_millis(publish.publish_timeout_ms.max(10_000));
    let ranges = tokio::task::block_in_place(|| replay::resolve(&consumer, source, &bounds, timeout))?;
    let total: i64 = ranges.values().map(replay::Range::len).sum();
    let targets = publish.task_topics();
    tracing::info!(?mode, source, target = ?targets.all(), ?ranges, dry_run = range.dry_run, "copying a range");
    let producer: FutureProducer = publish
        .kafka
        .producer_config("sluice-producer", publish.publish_timeout_ms.max(30_000), 20)
        .create()
        .context("creating the Kafka producer")?;
    if !range.dry_run {
        tokio::task::block_in_place(|| sluice_service::kafka::check_topics(producer.client(), &targets.all()))?;
    }
    let bar = if range.no_progress {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::with_draw_target(Some(total as u64), indicatif::ProgressDrawTarget::stderr())
    };
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} read, {per_sec}, {elapsed} {msg}").expect("template"));
    let verb = if range.dry_run { "would write" } else { "written" };
    let summary = replay::run(mode, consumer, &producer, source, &targets, &ranges, filter, range.dry_run, |s| {
        bar.set_position(s.read);
        bar.set_message(format!(
            "· {verb} {} · filtered {} · duplicates {} · unreadable {}",
            s.written, s.filtered, s.duplicates, s.unreadable
        ));
    })
    .await?;
    bar.finish();
    println!("{}", serde_json::to_string(&summary)?);
    Ok(ExitCode::SUCCESS)
}
