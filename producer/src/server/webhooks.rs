//! Webhooks in `serve`: the policy the API checks submitted webhooks against, and the notifier
//! that delivers them ([`crate::webhook`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::ServeError;
use super::view::View;
use crate::config::{ServeArgs, WebhookArgs};
use crate::metrics::Metrics;
use crate::presign::Presigner;
use crate::webhook::delivery::Deliverer;
use crate::webhook::guard::Guard;
use crate::webhook::schedule::RetrySchedule;
use crate::webhook::signing::Secrets;
use crate::webhook::{Notifier, Policy, Settings};

/// The SSRF guard and the signing secrets; built whether or not this replica delivers, since the
/// API checks every submitted webhook.
pub(super) fn policy(w: &WebhookArgs) -> Result<Policy, ServeError> {
    Ok(Policy {
        guard: Guard::new(&w.allow_cidrs, w.allow_http)?,
        secrets: Secrets::load(&w.secrets, w.secrets_file.as_deref())?,
    })
}

/// Starts the notifier on a task of its own: it waits for the view to catch up, then delivers
/// until `stop` resolves. A failure after it started is logged.
pub(super) fn start(
    args: &ServeArgs,
    policy: &Policy,
    view: &View,
    presigner: Arc<Presigner>,
    metrics: &Metrics,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let w = &args.webhooks;
    let settings = Settings {
        group: w.group.clone(),
        instance_id: w.group_instance_id.clone(),
        progress_topic: args.progress_topic.clone(),
        completions_topic: args.completions_topic.clone(),
        retry_topic: w.retry_topic.clone(),
        dlq_topic: w.dlq_topic.clone(),
        schedule: RetrySchedule::parse(&w.retry_schedule)?,
        concurrency: w.concurrency,
        max_pending: w.max_pending.max(1),
    };
    let deliverer = Deliverer::new(
        policy.guard.clone(),
        policy.secrets.clone(),
        Duration::from_millis(w.timeout_ms),
        w.host_concurrency,
    )?;
    let notifier = Arc::new(Notifier::new(
        settings,
        &args.publish.kafka,
        deliverer,
        view.store.clone(),
        presigner,
        metrics.clone(),
    )?);
    let caught_up = view.caught_up.clone();
    tokio::spawn(async move {
        if let Err(e) = notifier.run(caught_up, stop).await {
            tracing::error!(error = %e, "webhook notifier stopped");
        }
    });
    Ok(())
}
