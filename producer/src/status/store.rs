//! The store: the view in redb tables, a tenant's tasks indexed newest first, and how far each
//! partition has been read, all written in the same transactions.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;

use chrono::{DateTime, Utc};
use redb::{Database, ReadableTable, TableDefinition};
use uuid::Uuid;

use super::identity::Identity;
use super::{Change, Page, Status, StatusError, Stored, TaskStatus, WebhookTarget};

/// task id → the stored [`Stored`] JSON.
const TASKS: TableDefinition<&str, &[u8]> = TableDefinition::new("tasks");
/// `tenant \0 inverted created-at millis \0 task id` → (): a tenant's tasks, newest first.
const BY_TENANT: TableDefinition<&str, ()> = TableDefinition::new("by_tenant");
/// `topic \0 partition` → the next offset to read there.
const POSITIONS: TableDefinition<&str, i64> = TableDefinition::new("positions");
/// `format` → [`FORMAT`]: a store written in another format is rebuilt.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// `cluster` → the cluster id, `topic \0 name` → the topic's id: what the store was read from.
const IDENTITY: TableDefinition<&str, &str> = TableDefinition::new("identity");
const FORMAT: u64 = 2;
/// The most index entries one list request examines.
pub const MAX_LIST_SCAN: usize = 2_000;

fn store_error(e: impl std::fmt::Display) -> StatusError {
    StatusError::Store(e.to_string())
}

/// The stored status of task `id` (an unreadable entry counts as absent).
fn read_stored(tasks: &impl ReadableTable<&'static str, &'static [u8]>, id: &str) -> Result<Option<Stored>, StatusError> {
    Ok(tasks
        .get(id)
        .map_err(store_error)?
        .and_then(|v| serde_json::from_slice(v.value()).ok()))
}

fn tenant_key(tenant: &str, created_at: DateTime<Utc>, id: Uuid) -> String {
    let inverted = u64::MAX - created_at.timestamp_millis().max(0) as u64;
    format!("{tenant}\0{inverted:020}\0{id}")
}

/// The identity table's key of a topic's id: this prefix and the topic's name.
const TOPIC_KEY: &str = "topic\0";

/// Writes each topic's id into the identity table.
fn insert_topics(table: &mut redb::Table<&str, &str>, topics: &BTreeMap<String, String>) -> Result<(), StatusError> {
    for (topic, id) in topics {
        table
            .insert(format!("{TOPIC_KEY}{topic}").as_str(), id.as_str())
            .map_err(store_error)?;
    }
    Ok(())
}

/// The embedded store.
pub struct StatusStore {
    db: Database,
}

impl StatusStore {
    /// Creates the store at `path`, empty, recording the cluster and topics it will be read
    /// from when they are known: the view is rebuilt from the topics.
    pub fn create(path: &Path, identity: Option<&Identity>) -> Result<StatusStore, StatusError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(store_error)?;
        }
        let _ = std::fs::remove_file(path);
        let db = Database::create(path).map_err(store_error)?;
        let tx = db.begin_write().map_err(store_error)?;
        tx.open_table(TASKS).map_err(store_error)?;
        tx.open_table(BY_TENANT).map_err(store_error)?;
        tx.open_table(POSITIONS).map_err(store_error)?;
        tx.open_table(META)
            .map_err(store_error)?
            .insert("format", FORMAT)
            .map_err(store_error)?;
        {
            let mut table = tx.open_table(IDENTITY).map_err(store_error)?;
            if let Some(identity) = identity {
                table.insert("cluster", identity.cluster.as_str()).map_err(store_error)?;
                insert_topics(&mut table, &identity.topics)?;
            }
        }
        tx.commit().map_err(store_error)?;
        Ok(StatusStore { db })
    }

    /// Opens the store at `path` as a previous run left it, with how far it had read each
    /// partition, if it was read from `identity` (the cluster and the topics as they are now);
    /// creates it empty when there is none, when it is unreadable or of another format, or when
    /// it was read from another cluster or from topics since re-created (its positions belong to
    /// other data), or when the identity is unknown. Returns whether it was kept.
    pub fn open(path: &Path, identity: Option<&Identity>) -> Result<(StatusStore, bool), StatusError> {
        if path.exists() {
            let kept = Database::create(path)
                .ok()
                .map(|db| StatusStore { db })
                .filter(|s| s.format() == Some(FORMAT));
            match (kept, identity) {
                (Some(store), Some(now)) => match store.identity() {
                    Some(then) if then.continues_as(now) => {
                        // Topics newly read (a lane given a topic of its own): recorded, and read
                        // from their beginning; the others read on.
                        let added: BTreeMap<String, String> = now
                            .topics
                            .iter()
                            .filter(|(t, _)| !then.topics.contains_key(*t))
                            .map(|(t, id)| (t.clone(), id.clone()))
                            .collect();
                        if !added.is_empty() {
                            tracing::info!(added = ?added.keys().collect::<Vec<_>>(), "status store kept; topics new to it are read from their beginning");
                            store.record_topics(&added)?;
                        }
                        return Ok((store, true));
                    }
                    then => tracing::warn!(
                        path = %path.display(),
                        stored = ?then,
                        now = ?now,
                        "status store read from another cluster or from topics since re-created; rebuilding it from the topics"
                    ),
                },
                (Some(_), None) => tracing::warn!(
                    path = %path.display(),
                    "the cluster's and topics' ids are unknown, so the status store cannot be matched to them; rebuilding it from the topics"
                ),
                (None, _) => {
                    tracing::warn!(path = %path.display(), "status store of another format or unreadable; rebuilding it from the topics")
                }
            }
        }
        Ok((StatusStore::create(path, identity)?, false))
    }

    /// Records the ids of topics new to the store, beside those recorded (one no longer read
    /// stays recorded: read again later under another id, the store is rebuilt).
    fn record_topics(&self, added: &BTreeMap<String, String>) -> Result<(), StatusError> {
        let tx = self.db.begin_write().map_err(store_error)?;
        insert_topics(&mut tx.open_table(IDENTITY).map_err(store_error)?, added)?;
        tx.commit().map_err(store_error)
    }

    /// What the store was read from: as recorded when it was created, and the topics added since.
    fn identity(&self) -> Option<Identity> {
        let tx = self.db.begin_read().ok()?;
        let table = tx.open_table(IDENTITY).ok()?;
        let cluster = table.get("cluster").ok()??.value().to_owned();
        let mut topics = BTreeMap::new();
        for entry in table.iter().ok()? {
            let (k, v) = entry.ok()?;
            if let Some(topic) = k.value().strip_prefix(TOPIC_KEY) {
                topics.insert(topic.to_owned(), v.value().to_owned());
            }
        }
        Some(Identity { cluster, topics })
    }

    fn format(&self) -> Option<u64> {
        let tx = self.db.begin_read().ok()?;
        let meta = tx.open_table(META).ok()?;
        let format = meta.get("format").ok()??.value();
        Some(format)
    }

    /// How far each partition was read: the next offset, by `(topic, partition)`.
    pub fn positions(&self) -> Result<std::collections::HashMap<(String, i32), i64>, StatusError> {
        let tx = self.db.begin_read().map_err(store_error)?;
        let table = tx.open_table(POSITIONS).map_err(store_error)?;
        let mut out = std::collections::HashMap::new();
        for entry in table.iter().map_err(store_error)? {
            let (k, v) = entry.map_err(store_error)?;
            if let Some((topic, partition)) = k.value().rsplit_once('\0')
                && let Ok(partition) = partition.parse()
            {
                out.insert((topic.to_owned(), partition), v.value());
            }
        }
        Ok(out)
    }

    /// Applies changes in one transaction.
    pub fn apply(&self, changes: &[Change]) -> Result<(), StatusError> {
        self.apply_read(changes, &[])
    }

    /// Applies changes read from the topics and, in the same transaction, how far each
    /// partition has been read (`(topic, partition, next offset)`).
    pub fn apply_read(&self, changes: &[Change], read: &[(String, i32, i64)]) -> Result<(), StatusError> {
        if changes.is_empty() && read.is_empty() {
            return Ok(());
        }
        let tx = self.db.begin_write().map_err(store_error)?;
        if !read.is_empty() {
            let mut positions = tx.open_table(POSITIONS).map_err(store_error)?;
            for (topic, partition, next) in read {
                positions
                    .insert(format!("{topic}\0{partition}").as_str(), *next)
                    .map_err(store_error)?;
            }
        }
        {
            let mut tasks = tx.open_table(TASKS).map_err(store_error)?;
            let mut by_tenant = tx.open_table(BY_TENANT).map_err(store_error)?;
            for change in changes {
                let id = change.task_id().to_string();
                let existing = read_stored(&tasks, &id)?;
                let before = existing.as_ref().map(|s| (s.tenant.clone(), s.status.created_at));
                let Some(mut stored) = existing.or_else(|| change.first()) else {
                    continue;
                };
                stored.apply(change);
                let after = (stored.tenant.clone(), stored.status.created_at);
                if before.as_ref() != Some(&after) {
                    if let Some((tenant, created)) = before {
                        by_tenant
                            .remove(tenant_key(&tenant, created, stored.status.task_id).as_str())
                            .map_err(store_error)?;
                    }
                    by_tenant
                        .insert(tenant_key(&after.0, after.1, stored.status.task_id).as_str(), ())
                        .map_err(store_error)?;
                }
                let bytes = serde_json::to_vec(&stored).expect("status serializes");
                tasks.insert(id.as_str(), bytes.as_slice()).map_err(store_error)?;
            }
        }
        tx.commit().map_err(store_error)
    }

    /// The status of `id` if it belongs to `tenant` (another tenant's task is as unknown as a
    /// task that does not exist).
    pub fn get(&self, tenant: &str, id: Uuid) -> Result<Option<TaskStatus>, StatusError> {
        Ok(self.tenants_task(tenant, id)?.map(|s| s.status))
    }

    /// What the store keeps of `id`, if it belongs to `tenant`.
    fn tenants_task(&self, tenant: &str, id: Uuid) -> Result<Option<Stored>, StatusError> {
        let tx = self.db.begin_read().map_err(store_error)?;
        let tasks = tx.open_table(TASKS).map_err(store_error)?;
        Ok(read_stored(&tasks, &id.to_string())?.filter(|s| s.tenant == tenant))
    }

    /// For the webhook notifier: task `id`'s tenant, its webhook and its status once `change`
    /// is applied (what `GET /v1/tasks/{id}` answers right after the view applies it), without
    /// writing anything. `None` while the view has not read the task's record, or when the task
    /// has no webhook.
    pub fn with_webhook(&self, id: Uuid, change: &Change) -> Result<Option<WebhookTarget>, StatusError> {
        let tx = self.db.begin_read().map_err(store_error)?;
        let tasks = tx.open_table(TASKS).map_err(store_error)?;
        let Some(mut stored) = read_stored(&tasks, &id.to_string())? else {
            return Ok(None);
        };
        let Some(webhook) = stored.webhook.take() else {
            return Ok(Some(WebhookTarget {
                tenant: stored.tenant,
                webhook: None,
                awaiting_record: stored.awaiting_record,
                status: stored.status,
            }));
        };
        stored.apply(change);
        Ok(Some(WebhookTarget {
            tenant: stored.tenant,
            webhook: Some(webhook),
            awaiting_record: false,
            status: stored.status,
        }))
    }

    /// For a task of `tenant`: `Some(request hash)` (`Some(None)` when it was submitted without
    /// an idempotency key); `None` when the view does not know it.
    pub fn request_hash(&self, tenant: &str, id: Uuid) -> Result<Option<Option<String>>, StatusError> {
        Ok(self.tenants_task(tenant, id)?.map(|s| s.request_sha256))
    }

    /// A tenant's tasks, newest first, `limit` at most, after `cursor`, optionally only those
    /// with `status` or created at or after `since`.
    pub fn list(
        &self,
        tenant: &str,
        status: Option<Status>,
        since: Option<DateTime<Utc>>,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<Page, StatusError> {
        let tx = self.db.begin_read().map_err(store_error)?;
        let tasks = tx.open_table(TASKS).map_err(store_error)?;
        let by_tenant = tx.open_table(BY_TENANT).map_err(store_error)?;
        let prefix = format!("{tenant}\0");
        let end = format!("{tenant}\u{1}");
        let after = match cursor {
            Some(c) => Some(format!(
                "{prefix}{}",
                cursor_key(c).ok_or_else(|| StatusError::Cursor(c.to_owned()))?
            )),
            None => None,
        };
        let start = match &after {
            Some(key) => Bound::Excluded(key.as_str()),
            None => Bound::Included(prefix.as_str()),
        };
        let mut page: Vec<TaskStatus> = Vec::new();
        let mut more = false;
        // Bounded work: a filter that skips most tasks stops after MAX_LIST_SCAN of them, with
        // a cursor where it stopped (the page may then hold fewer than `limit`, even none).
        let mut stopped_at: Option<String> = None;
        for (examined, entry) in by_tenant
            .range::<&str>((start, Bound::Excluded(end.as_str())))
            .map_err(store_error)?
            .enumerate()
        {
            let (key, _) = entry.map_err(store_error)?;
            if examined == MAX_LIST_SCAN && page.len() < limit {
                more = true;
                break;
            }
            stopped_at = key.value().strip_prefix(prefix.as_str()).map(|k| k.replacen('\0', ".", 1));
            let id = key.value().rsplit('\0').next().unwrap_or_default().to_owned();
            let Some(stored) = read_stored(&tasks, &id)? else {
                continue;
            };
            if since.is_some_and(|s| stored.status.created_at < s) {
                break; // newest first: everything after is older
            }
            if status.is_some_and(|s| stored.status.status != s) {
                continue;
            }
            if page.len() == limit {
                more = true;
                break;
            }
            page.push(stored.status);
        }
        let next_cursor = match page.last() {
            _ if !more => None,
            Some(last) if page.len() == limit => Some(format!(
                "{:020}.{}",
                u64::MAX - last.created_at.timestamp_millis().max(0) as u64,
                last.task_id
            )),
            _ => stopped_at, // the scan bound: on from the last task examined
        };
        Ok(Page { tasks: page, next_cursor })
    }

    /// Drops finished tasks last updated before `finished_before`, and unfinished ones last
    /// updated before `open_before` (which the caller sets past the longest a task may wait, so
    /// that a task that can still run never disappears from the view with its webhooks).
    pub fn prune(&self, finished_before: DateTime<Utc>, open_before: DateTime<Utc>) -> Result<usize, StatusError> {
        let tx = self.db.begin_write().map_err(store_error)?;
        let mut removed = 0;
        {
            let mut tasks = tx.open_table(TASKS).map_err(store_error)?;
            let mut by_tenant = tx.open_table(BY_TENANT).map_err(store_error)?;
            let old: Vec<Stored> = tasks
                .iter()
                .map_err(store_error)?
                .filter_map(|e| e.ok())
                .filter_map(|(_, v)| serde_json::from_slice::<Stored>(v.value()).ok())
                .filter(|s| {
                    let before = if s.status.status.is_terminal() {
                        finished_before
                    } else {
                        open_before
                    };
                    s.status.updated_at < before
                })
                .collect();
            for s in old {
                tasks.remove(s.status.task_id.to_string().as_str()).map_err(store_error)?;
                by_tenant
                    .remove(tenant_key(&s.tenant, s.status.created_at, s.status.task_id).as_str())
                    .map_err(store_error)?;
                removed += 1;
            }
        }
        tx.commit().map_err(store_error)?;
        Ok(removed)
    }
}

/// Cursor text → the key suffix it stands for.
pub fn cursor_key(cursor: &str) -> Option<String> {
    let (inverted, id) = cursor.split_once('.')?;
    if inverted.len() != 20 || !inverted.bytes().all(|b| b.is_ascii_digit()) || Uuid::parse_str(id).is_err() {
        return None;
    }
    Some(format!("{inverted}\0{id}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Progress;
    use sluice_schemas::{
        CompletionError, CompletionEvent, CompletionStatus, Generation, ProgressEvent, ProgressRecord, SourceRef, TaskRecord, Timings,
    };

    fn record(id: Uuid, tenant: &str, at: DateTime<Utc>) -> TaskRecord {
        TaskRecord {
            version: 1,
            task_id: id,
            submitted_at: at,
            tenant: tenant.into(),
            user: None,
            model: "sd".into(),
            request: Generation {
                prompt: "p".into(),
                negative_prompt: None,
                steps: 4,
                guidance_scale: 7.5,
                seed: 1,
                sampler: "euler".into(),
                width: 64,
                height: 64,
                num_images: 1,
                params: Default::default(),
                init_image: None,
                mask_image: None,
                strength: None,
            },
            idempotency: None,
            deadline: None,
            priority: Default::default(),
            webhook: None,
        }
    }

    fn progress(id: Uuid, step: u32) -> ProgressRecord {
        ProgressRecord {
            version: 1,
            task_id: id,
            model: "sd".into(),
            worker_id: "w".into(),
            event: ProgressEvent::Step,
            step,
            steps: 4,
            at: Utc::now(),
        }
    }

    fn completion(id: Uuid, tenant: &str, status: CompletionStatus, attempt: u32) -> CompletionEvent {
        CompletionEvent {
            version: 1,
            task_id: id,
            status,
            model: "sd".into(),
            tenant: tenant.into(),
            user: None,
            outputs: Vec::new(),
            error: None,
            timings: Timings::default(),
            worker_id: "w".into(),
            attempt,
            completed_at: Utc::now(),
            source: SourceRef {
                topic: "t".into(),
                partition: 0,
                offset: 0,
            },
        }
    }

    fn identity(cluster: &str, tasks_topic_id: &str) -> Identity {
        Identity {
            cluster: cluster.into(),
            topics: [("tasks".to_owned(), tasks_topic_id.to_owned())].into(),
        }
    }

    fn store() -> (StatusStore, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("sluice-status-{}-{}.redb", std::process::id(), Uuid::new_v4()));
        (StatusStore::create(&path, Some(&identity("c1", "t1"))).unwrap(), path)
    }

    /// A completion read before its task's record: the view says the record is awaited (the
    /// webhook notifier waits for it, rather than take the task for one without a webhook).
    #[test]
    fn a_completion_read_before_its_record_awaits_the_record() {
        let (s, path) = store();
        let id = Uuid::now_v7();
        let done = Change::Completed(completion(id, "t", CompletionStatus::Succeeded, 1));
        s.apply(std::slice::from_ref(&done)).unwrap();
        let early = s.with_webhook(id, &done).unwrap().unwrap();
        assert!(early.awaiting_record && early.webhook.is_none());
        let mut r = record(id, "t", Utc::now());
        r.webhook = Some(sluice_schemas::WebhookSpec {
            url: "https://example.com/hook".into(),
            events: vec![sluice_schemas::WebhookEvent::Completed],
        });
        s.apply(&[Change::Queued(r)]).unwrap();
        let known = s.with_webhook(id, &done).unwrap().unwrap();
        assert!(!known.awaiting_record && known.webhook.is_some());
        assert_eq!(known.status.status, Status::Succeeded);
        let _ = std::fs::remove_file(path);
    }

    /// Two outcomes of one attempt (an owner that lost the partition while the task ran
    /// announced it late): a success stands, in either order.
    #[test]
    fn a_late_outcome_of_an_attempt_never_overwrites_its_success() {
        let (s, path) = store();
        let crashed = |id| {
            let mut c = completion(id, "t", CompletionStatus::Failed, 1);
            c.error = Some(sluice_schemas::CompletionError {
                reason: sluice_schemas::DlqReason::Crashed,
                message: "started 3 times".into(),
            });
            Change::Completed(c)
        };
        let succeeded = |id| Change::Completed(completion(id, "t", CompletionStatus::Succeeded, 1));
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        s.apply(&[Change::Queued(record(a, "t", Utc::now())), succeeded(a), crashed(a)])
            .unwrap();
        s.apply(&[Change::Queued(record(b, "t", Utc::now())), crashed(b), succeeded(b)])
            .unwrap();
        for id in [a, b] {
            assert_eq!(s.get("t", id).unwrap().unwrap().status, Status::Succeeded);
        }
        // A later attempt (a redrive) is another matter: its outcome replaces the first's.
        s.apply(&[Change::Completed(completion(a, "t", CompletionStatus::Failed, 2))])
            .unwrap();
        assert_eq!(s.get("t", a).unwrap().unwrap().status, Status::Failed);
        let _ = std::fs::remove_file(path);
    }

    /// Two requests with one idempotency key (one raced past the producer's check): the view
    /// shows the first, in either order of its outcome and the refusal of the second.
    #[test]
    fn a_reused_key_leaves_the_first_request_in_the_view() {
        let (s, path) = store();
        let keyed = |hash: &str, seed: u64| {
            let mut r = record(Uuid::nil(), "t", Utc::now());
            r.request.seed = seed;
            r.idempotency = Some(sluice_schemas::Idempotency {
                key: "k".into(),
                request_sha256: hash.repeat(64),
            });
            r
        };
        let refused = || {
            let mut c = completion(Uuid::nil(), "t", CompletionStatus::Failed, 1);
            c.error = Some(sluice_schemas::CompletionError {
                reason: sluice_schemas::DlqReason::IdempotencyConflict,
                message: "reused".into(),
            });
            c
        };
        let succeeded = completion(Uuid::nil(), "t", CompletionStatus::Succeeded, 1);
        for order in [[0, 1], [1, 0]] {
            let outcomes = [Change::Completed(succeeded.clone()), Change::Completed(refused())];
            let mut changes = vec![Change::Queued(keyed("a", 1)), Change::Queued(keyed("b", 2))];
            changes.extend(order.map(|i| outcomes[i].clone()));
            s.apply(&changes).unwrap();
            let status = s.get("t", Uuid::nil()).unwrap().unwrap();
            assert_eq!(status.status, Status::Succeeded, "order {order:?}");
            assert_eq!(s.request_hash("t", Uuid::nil()).unwrap(), Some(Some("a".repeat(64))));
        }
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_filtered_list_examines_a_bounded_number_of_tasks_and_goes_on_from_where_it_stopped() {
        let (s, path) = store();
        let base = Utc::now() - chrono::Duration::hours(1);
        // The oldest task runs; MAX_LIST_SCAN + 10 newer ones have succeeded.
        let running = Uuid::now_v7();
        let mut changes = vec![Change::Queued(record(running, "t", base)), Change::Progress(progress(running, 1))];
        for i in 0..MAX_LIST_SCAN + 10 {
            let id = Uuid::now_v7();
            changes.push(Change::Queued(record(id, "t", base + chrono::Duration::milliseconds(1 + i as i64))));
            changes.push(Change::Completed(completion(id, "t", CompletionStatus::Succeeded, 1)));
        }
        s.apply(&changes).unwrap();
        let first = s.list("t", Some(Status::Running), None, 10, None).unwrap();
        assert!(first.tasks.is_empty(), "the scan stopped before reaching it");
        let cursor = first.next_cursor.expect("a cursor where the scan stopped");
        let second = s.list("t", Some(Status::Running), None, 10, Some(&cursor)).unwrap();
        assert_eq!(second.tasks.iter().map(|t| t.task_id).collect::<Vec<_>>(), [running]);
        assert!(second.next_cursor.is_none());
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_reopened_store_keeps_its_tasks_and_positions_and_another_format_is_rebuilt() {
        let (s, path) = store();
        let a = Uuid::now_v7();
        s.apply_read(&[Change::Queued(record(a, "t", Utc::now()))], &[("tasks".into(), 3, 42)])
            .unwrap();
        drop(s);
        let (s, kept) = StatusStore::open(&path, Some(&identity("c1", "t1"))).unwrap();
        assert!(kept);
        assert!(s.get("t", a).unwrap().is_some());
        assert_eq!(s.positions().unwrap()[&("tasks".to_owned(), 3)], 42);
        drop(s);
        // A store without the format mark (as written before positions were kept) is rebuilt.
        {
            let db = Database::create(&path).unwrap();
            let tx = db.begin_write().unwrap();
            tx.delete_table(META).unwrap();
            tx.commit().unwrap();
        }
        let (s, kept) = StatusStore::open(&path, Some(&identity("c1", "t1"))).unwrap();
        assert!(!kept);
        assert!(s.get("t", a).unwrap().is_none());
        assert!(s.positions().unwrap().is_empty());
        let _ = std::fs::remove_file(path);
    }

    /// A store read from another cluster, from a topic since re-created (a new topic id), or
    /// whose cluster cannot be told now, is rebuilt; the same cluster and topics keep it, and so
    /// does a topic more (a lane's own) or fewer.
    #[test]
    fn a_store_of_another_cluster_or_of_re_created_topics_is_rebuilt() {
        let with_lane = |lane_id: &str| {
            let mut i = identity("c1", "t1");
            i.topics.insert("interactive".into(), lane_id.into());
            i
        };
        let without_tasks = Identity {
            cluster: "c1".into(),
            topics: Default::default(),
        };
        for (now, keeps) in [
            (Some(identity("c1", "t1")), true),
            (Some(with_lane("i1")), true),
            (Some(without_tasks), true),
            (Some(identity("c2", "t1")), false),
            (Some(identity("c1", "t2")), false),
            (None, false),
        ] {
            let (s, path) = store();
            let a = Uuid::now_v7();
            s.apply_read(&[Change::Queued(record(a, "t", Utc::now()))], &[("tasks".into(), 0, 1)])
                .unwrap();
            drop(s);
            let (s, kept) = StatusStore::open(&path, now.as_ref()).unwrap();
            assert_eq!(kept, keeps, "{now:?}");
            assert_eq!(s.get("t", a).unwrap().is_some(), keeps, "{now:?}");
            drop(s);
            if let Some(now) = &now {
                // Rebuilt for `now` (or its new topics recorded), it is kept for `now` next time.
                assert!(StatusStore::open(&path, Some(now)).unwrap().1, "{now:?}");
            }
            let _ = std::fs::remove_file(path);
        }
        // A topic added is recorded: once it is re-created, the store is rebuilt.
        let (s, path) = store();
        drop(s);
        assert!(StatusStore::open(&path, Some(&with_lane("i1"))).unwrap().1);
        assert!(
            !StatusStore::open(&path, Some(&with_lane("i2"))).unwrap().1,
            "the lane's topic re-created"
        );
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn a_redriven_task_is_its_new_attempt_whatever_order_the_topics_are_read_in() {
        let (s, path) = store();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let at = Utc::now();
        let redriven = |id| Change::Redriven {
            record: record(id, "t", at),
            attempt: 2,
            at: Utc::now(),
        };
        let failed = |id| {
            let mut c = completion(id, "t", CompletionStatus::Failed, 1);
            c.error = Some(CompletionError {
                reason: sluice_schemas::DlqReason::ModelError,
                message: "boom".into(),
            });
            c
        };
        // a: the failure, then the redrive. b: the redrive read before the failure.
        s.apply(&[Change::Queued(record(a, "t", at)), Change::Completed(failed(a)), redriven(a)])
            .unwrap();
        s.apply(&[Change::Queued(record(b, "t", at)), redriven(b), Change::Completed(failed(b))])
            .unwrap();
        for id in [a, b] {
            let st = s.get("t", id).unwrap().unwrap();
            assert_eq!((st.status, st.attempt, st.error.is_none()), (Status::Queued, 2, true), "{id}");
        }
        // The new attempt's result replaces it; the same redrive read again changes nothing.
        s.apply(&[Change::Completed(completion(a, "t", CompletionStatus::Succeeded, 2)), redriven(a)])
            .unwrap();
        let st = s.get("t", a).unwrap().unwrap();
        assert_eq!((st.status, st.attempt), (Status::Succeeded, 2));
        let _ = std::fs::remove_file(path);
    }

    /// A `started` record past step 0 (a task that carried on from its step checkpoint) shows
    /// in the status as `resumed_from`, kept through later steps and records read out of order.
    #[test]
    fn a_task_that_carried_on_from_a_checkpoint_says_from_which_step() {
        let (s, path) = store();
        let a = Uuid::now_v7();
        let started = |step| ProgressRecord {
            event: ProgressEvent::Started,
            ..progress(a, step)
        };
        s.apply(&[Change::Queued(record(a, "t", Utc::now())), Change::Progress(started(0))])
            .unwrap();
        let resumed_from = |s: &StatusStore| s.get("t", a).unwrap().unwrap().progress.unwrap().resumed_from;
        assert_eq!(resumed_from(&s), None, "from the start");
        s.apply(&[
            Change::Progress(progress(a, 1)),
            Change::Progress(started(2)),
            Change::Progress(progress(a, 3)),
        ])
        .unwrap();
        assert_eq!(resumed_from(&s), Some(2));
        // A late record of the first run changes neither the step nor where it carried on from.
        s.apply(&[Change::Progress(progress(a, 1))]).unwrap();
        let progress = s.get("t", a).unwrap().unwrap().progress.unwrap();
        assert_eq!((progress.step, progress.resumed_from), (3, Some(2)));
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn changes_in_any_order_end_in_the_same_state_and_a_result_is_never_undone() {
        let (s, path) = store();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let at = Utc::now();
        // a: in order. b: the completion first, then a late progress record, then the task.
        s.apply(&[Change::Queued(record(a, "t", at)), Change::Progress(progress(a, 2))])
            .unwrap();
        assert_eq!(s.get("t", a).unwrap().unwrap().status, Status::Running);
        assert_eq!(
            s.get("t", a).unwrap().unwrap().progress,
            Some(Progress {
                step: 2,
                steps: 4,
                resumed_from: None
            })
        );
        s.apply(&[Change::Completed(completion(a, "t", CompletionStatus::Succeeded, 1))])
            .unwrap();
        s.apply(&[
            Change::Completed(completion(b, "t", CompletionStatus::Failed, 1)),
            Change::Progress(progress(b, 3)),
            Change::Queued(record(b, "t", at)),
        ])
        .unwrap();
        assert_eq!(s.get("t", a).unwrap().unwrap().status, Status::Succeeded);
        let b_status = s.get("t", b).unwrap().unwrap();
        assert_eq!(b_status.status, Status::Failed, "a late progress record does not undo the result");
        assert_eq!(b_status.created_at, at, "the task record sets the creation time");
        // A second attempt's completion replaces the first; a stale one does not.
        s.apply(&[Change::Completed(completion(b, "t", CompletionStatus::Succeeded, 2))])
            .unwrap();
        s.apply(&[Change::Completed(completion(b, "t", CompletionStatus::Failed, 1))])
            .unwrap();
        assert_eq!(s.get("t", b).unwrap().unwrap().status, Status::Succeeded);
        assert_eq!(s.get("t", b).unwrap().unwrap().attempt, 2);
        // Another tenant sees nothing.
        assert!(s.get("other", a).unwrap().is_none());
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn a_tenant_pages_through_its_tasks_newest_first_and_pruning_drops_old_ones() {
        let (s, path) = store();
        let base = Utc::now() - chrono::Duration::hours(1);
        let ids: Vec<Uuid> = (0..7).map(|_| Uuid::now_v7()).collect();
        for (i, id) in ids.iter().enumerate() {
            let tenant = if i == 3 { "other" } else { "t" };
            s.apply(&[Change::Queued(record(*id, tenant, base + chrono::Duration::seconds(i as i64)))])
                .unwrap();
        }
        let mut seen = Vec::new();
        let mut cursor = None;
        loop {
            let page = s.list("t", None, None, 2, cursor.as_deref()).unwrap();
            seen.extend(page.tasks.iter().map(|t| t.task_id));
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        let want: Vec<Uuid> = ids.iter().enumerate().rev().filter(|(i, _)| *i != 3).map(|(_, id)| *id).collect();
        assert_eq!(seen, want);
        let since = s.list("t", None, Some(base + chrono::Duration::seconds(5)), 10, None).unwrap();
        assert_eq!(since.tasks.len(), 2);
        assert!(s.list("t", None, None, 2, Some("garbage")).is_err());
        let cut = base + chrono::Duration::seconds(2);
        assert_eq!(s.prune(cut, cut).unwrap(), 2);
        assert_eq!(s.list("t", None, None, 10, None).unwrap().tasks.len(), 4);
        std::fs::remove_file(path).ok();
    }

    /// A task that has not finished outlives the retention of finished ones: it may still run
    /// (a deadline can be 30 days away) and its webhooks are still to be sent.
    #[test]
    fn unfinished_tasks_are_kept_past_the_retention_of_finished_ones() {
        let (s, path) = store();
        let base = Utc::now() - chrono::Duration::hours(200);
        let (waiting, done) = (Uuid::now_v7(), Uuid::now_v7());
        s.apply(&[Change::Queued(record(waiting, "t", base)), Change::Queued(record(done, "t", base))])
            .unwrap();
        s.apply(&[Change::Completed(completion(done, "t", CompletionStatus::Succeeded, 1))])
            .unwrap();
        let retention = Utc::now() + chrono::Duration::seconds(1); // everything finished goes
        assert_eq!(s.prune(retention, base - chrono::Duration::hours(1)).unwrap(), 1);
        assert!(s.get("t", waiting).unwrap().is_some(), "still queued: kept");
        assert!(s.get("t", done).unwrap().is_none());
        assert_eq!(
            s.prune(retention, base + chrono::Duration::hours(1)).unwrap(),
            1,
            "past its own bound"
        );
        std::fs::remove_file(path).ok();
    }
}
