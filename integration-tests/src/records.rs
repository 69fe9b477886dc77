//! Task records as the producer publishes them, and what became of them: the completion and DLQ
//! records read back from the topics.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use rdkafka::producer::FutureProducer;
use serde_json::{Value, json};
use sluice_schemas::{CompletionEvent, CompletionStatus, DlqRecord};

use crate::kafka::{TopicReader, produce_raw};
use crate::stack::Topics;

/// A valid version-1 terrain task record of tenant `acme`: its task id and its JSON.
pub fn terrain_task(seed: u64, width: u32, height: u32, difficulty: u32) -> (String, Value) {
    let id = uuid::Uuid::now_v7().to_string();
    let record = json!({
        "version": 1, "task_id": id, "submitted_at": chrono::Utc::now().to_rfc3339(), "tenant": "acme", "user": null, "model": "terrain",
        "request": {"prompt": "", "negative_prompt": "", "steps": 1, "guidance_scale": 1.0, "seed": seed, "sampler": "onestep",
                    "width": width, "height": height, "num_images": 1,
                    "params": {"difficulty": difficulty, "colormap": "terrain", "tile_overlap": 32}}
    });
    (id, record)
}

/// A valid version-1 Stable Diffusion task record of tenant `acme` for the demo catalog's
/// `sd-tiny` (euler, guidance 7.5): its task id and its JSON.
pub fn sd_task(seed: u64, size: u32, steps: u32, num_images: u32) -> (String, Value) {
    let id = uuid::Uuid::now_v7().to_string();
    let record = json!({
        "version": 1, "task_id": id, "submitted_at": chrono::Utc::now().to_rfc3339(), "tenant": "acme", "user": null, "model": "sd-tiny",
        "request": {"prompt": format!("a lighthouse, variant {}", seed % 7), "negative_prompt": "blurry", "steps": steps,
                    "guidance_scale": 7.5, "seed": seed, "sampler": "euler", "width": size, "height": size,
                    "num_images": num_images, "params": {}}
    });
    (id, record)
}

/// The demo catalog (`deploy/models.demo.toml`), which the tests and benchmarks serve.
pub fn demo_catalog() -> &'static sluice_schemas::Catalog {
    static CATALOG: std::sync::OnceLock<sluice_schemas::Catalog> = std::sync::OnceLock::new();
    CATALOG.get_or_init(|| {
        let path = crate::stack::repo_root().join("deploy/models.demo.toml");
        sluice_schemas::Catalog::parse(&std::fs::read_to_string(path).expect("the demo catalog")).expect("a valid catalog")
    })
}

/// A task record for a diffusion model of the demo catalog: [`sd_task`]'s, on `model`, with the
/// catalog's default sampler (flow_euler for FLUX.1 and SD3) and without the negative prompt
/// where the model takes none (FLUX.1).
pub fn diffusion_task(model: &str, seed: u64, size: u32, steps: u32, num_images: u32) -> (String, Value) {
    let entry = demo_catalog().get(model).expect("a model of the demo catalog");
    diffusion_task_of(model, entry, seed, size, steps, num_images)
}

/// [`diffusion_task`] for a model of any catalog, with its catalog entry.
pub fn diffusion_task_of(
    model: &str,
    entry: &sluice_schemas::CatalogModel,
    seed: u64,
    size: u32,
    steps: u32,
    num_images: u32,
) -> (String, Value) {
    let (id, mut record) = sd_task(seed, size, steps, num_images);
    record["model"] = model.into();
    if !entry.samplers.iter().any(|s| s == "euler") {
        record["request"]["sampler"] = entry.default_sampler.clone().into();
        record["request"]["guidance_scale"] = entry.guidance_scale.default.into();
    }
    if !entry.negative_prompt {
        record["request"].as_object_mut().expect("an object").remove("negative_prompt");
    }
    (id, record)
}

/// Reads completions on the default topics until every id in `ids` has one; the first of each,
/// by task id.
pub fn completions_for(brokers: &str, ids: &BTreeSet<String>, timeout: Duration) -> HashMap<String, CompletionEvent> {
    Outcomes::wait(brokers, &Topics::default(), ids, timeout)
        .unwrap()
        .completions
        .into_iter()
        .map(|(id, mut cs)| (id, cs.swap_remove(0)))
        .collect()
}

/// Publishes task records (key = task id, schema-version header), all awaiting their
/// acknowledgement at once.
pub async fn publish_tasks(producer: &FutureProducer, topic: &str, tasks: &[(String, Value)]) -> anyhow::Result<()> {
    let sends = tasks.iter().map(|(id, record)| async move {
        let value = serde_json::to_vec(record)?;
        produce_raw(producer, topic, Some(id.as_bytes()), &value, &[("sluice-schema-version", b"1")]).await
    });
    for sent in futures::future::join_all(sends).await {
        sent?;
    }
    Ok(())
}

/// Publishes one task, keyed by its id, to partition `partition` of `topic`.
pub async fn publish_to_partition(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    (id, record): &(String, Value),
) -> anyhow::Result<()> {
    let value = serde_json::to_vec(record)?;
    let headers: &[(&str, &[u8])] = &[(sluice_schemas::HEADER_SCHEMA_VERSION, b"1")];
    crate::kafka::produce_to(producer, topic, Some(partition), Some(id.as_bytes()), &value, headers).await?;
    Ok(())
}

/// What became of a set of tasks, by task id: every completion and every DLQ record of each
/// (more than one means it was announced twice).
#[derive(Debug, Default)]
pub struct Outcomes {
    pub completions: HashMap<String, Vec<CompletionEvent>>,
    pub dlq: HashMap<String, Vec<DlqRecord>>,
}

impl Outcomes {
    /// Reads the completions topic of `topics` until every id in `ids` has a completion, then
    /// the DLQ topic until every failed one has its DLQ record. Fails after `timeout`, naming
    /// what is missing. Blocks (in place, when called from a multi-threaded runtime).
    pub fn wait(brokers: &str, topics: &Topics, ids: &BTreeSet<String>, timeout: Duration) -> anyhow::Result<Outcomes> {
        Outcomes::wait_settled(brokers, topics, ids, timeout, |cs| !cs.is_empty())
    }

    /// Like [`Outcomes::wait`], reading until `settled` holds for the completions of every id.
    pub fn wait_settled(
        brokers: &str,
        topics: &Topics,
        ids: &BTreeSet<String>,
        timeout: Duration,
        settled: impl Fn(&[CompletionEvent]) -> bool,
    ) -> anyhow::Result<Outcomes> {
        tokio::task::block_in_place(|| Outcomes::read(brokers, topics, ids, timeout, settled))
    }

    fn read(
        brokers: &str,
        topics: &Topics,
        ids: &BTreeSet<String>,
        timeout: Duration,
        settled: impl Fn(&[CompletionEvent]) -> bool,
    ) -> anyhow::Result<Outcomes> {
        let deadline = std::time::Instant::now() + timeout;
        let mut outcomes = Outcomes::default();
        let mut reader = TopicReader::new(brokers, &topics.completions)?;
        let mut missing = ids.clone();
        let read = reader.read_each(timeout, |r| {
            if let Ok(c) = serde_json::from_slice::<CompletionEvent>(&r.value) {
                let id = c.task_id.to_string();
                if ids.contains(&id) {
                    let all = outcomes.completions.entry(id.clone()).or_default();
                    all.push(c);
                    if settled(all) {
                        missing.remove(&id);
                    }
                }
            }
            missing.is_empty()
        });
        if let Err(e) = read {
            anyhow::bail!(
                "{e}: no completion for {} of {} tasks, e.g. {:?}",
                missing.len(),
                ids.len(),
                missing.iter().take(5).collect::<Vec<_>>()
            );
        }
        let mut failed: BTreeSet<String> = outcomes
            .completions
            .iter()
            .filter(|(_, cs)| cs.iter().any(|c| c.status == CompletionStatus::Failed))
            .map(|(id, _)| id.clone())
            .collect();
        if !failed.is_empty() {
            let mut reader = TopicReader::new(brokers, &topics.dlq)?;
            let left = deadline
                .saturating_duration_since(std::time::Instant::now())
                .max(Duration::from_secs(10));
            let read = reader.read_each(left, |r| {
                if let Some(d) = serde_json::from_slice::<DlqRecord>(&r.value).ok().filter(|d| d.task_id.is_some()) {
                    let id = d.task_id.expect("checked").to_string();
                    if ids.contains(&id) {
                        failed.remove(&id);
                        outcomes.dlq.entry(id).or_default().push(d);
                    }
                }
                failed.is_empty()
            });
            if let Err(e) = read {
                anyhow::bail!("{e}: no DLQ record for failed tasks {failed:?}");
            }
        }
        Ok(outcomes)
    }

    /// Ids whose (first) completion says `status`.
    pub fn with_status(&self, status: CompletionStatus) -> BTreeSet<String> {
        self.completions
            .iter()
            .filter(|(_, cs)| cs[0].status == status)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// DLQ reason of a failed task.
    pub fn dlq_reason(&self, id: &str) -> Option<&str> {
        self.dlq.get(id).map(|d| d[0].reason.as_str())
    }
}

/// `(task id, JSON)` pairs into the set of their ids.
pub fn ids_of(tasks: &[(String, Value)]) -> BTreeSet<String> {
    tasks.iter().map(|(id, _)| id.clone()).collect()
}
