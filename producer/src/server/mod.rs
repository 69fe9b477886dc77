//! `sluice-producer serve` as library code, in roles: [`serve`] opens the status view and starts
//! its feed (`view`), starts the backlog measurement, the webhook notifier (`webhooks`), binds the
//! listeners (`http`), serves the API until `shutdown`, then drains (`drain`): the API finishes
//! the requests in flight and the notifier stops. `main` only parses the command line and calls
//! it.

mod drain;
mod http;
mod view;
mod webhooks;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::error::KafkaError;
use sluice_schemas::{Catalog, CatalogError};
use thiserror::Error;

use crate::api::AppState;
use crate::auth::{ApiKeys, AuthError, TenantLanes};
use crate::config::ServeArgs;
use crate::input_images::InputImages;
use crate::metrics::Metrics;
use crate::presign::Presigner;
use crate::publish::TaskPublisher;
use crate::status::{FeedError, StatusError};
use crate::streams::Streams;
use crate::webhook::NotifierError;
use crate::webhook::guard::Refused;
use crate::webhook::schedule::ScheduleError;
use crate::webhook::signing::SecretsError;

/// What can keep the producer from serving, by what failed. The message says what was being
/// done where there is more to say than the cause; the cause is the error's `source()`.
#[derive(Debug, Error)]
pub enum ServeError {
    #[error(transparent)]
    ApiKeys(#[from] AuthError),
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error("opening the status view at {}", path.display())]
    StatusStore {
        path: PathBuf,
        #[source]
        source: StatusError,
    },
    #[error(transparent)]
    StatusFeed(#[from] FeedError),
    #[error("starting the backlog measurement")]
    Backlog(#[source] KafkaError),
    #[error(transparent)]
    WebhookGuard(#[from] Refused),
    #[error(transparent)]
    WebhookSecrets(#[from] SecretsError),
    #[error(transparent)]
    WebhookSchedule(#[from] ScheduleError),
    #[error(transparent)]
    WebhookClient(#[from] reqwest::Error),
    #[error(transparent)]
    Notifier(#[from] NotifierError),
    #[error("creating the Kafka producer")]
    Publisher(#[source] KafkaError),
    #[error(transparent)]
    Topics(#[from] sluice_service::kafka::MissingTopics),
    #[error("invalid input store URL {url}")]
    InputStore {
        url: String,
        #[source]
        source: sluice_service::object_url::ObjectUrlError,
    },
    #[error("binding the metrics listener {addr}")]
    MetricsListener {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("binding {addr}")]
    Listener {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The API's server stopped with an error.
    #[error(transparent)]
    Http(std::io::Error),
}

/// Serves the HTTP API until `shutdown` resolves, then drains. Everything that can be wrong with
/// the setup fails here, with a message, before the API listens.
pub async fn serve(args: ServeArgs, shutdown: impl Future<Output = ()>) -> Result<(), ServeError> {
    let metrics = Metrics::new();
    let keys = api_keys(&args)?;
    let lanes = TenantLanes::parse(&args.tenant_lanes)?;
    let catalog = Catalog::load(args.publish.model_catalog.as_deref())?;
    tracing::info!(models = ?catalog.names(), "model catalog");
    let publisher = TaskPublisher::connect(&args.publish, &metrics).map_err(ServeError::Publisher)?;
    let checking = publisher.clone();
    tokio::task::spawn_blocking(move || checking.check_topics())
        .await
        .expect("the topic check does not panic")?;
    let view = view::start(&args, &catalog, &metrics)?;
    start_backlog(&args, &metrics)?;
    let presigner = Arc::new(Presigner::new(Duration::from_secs(args.presign_ttl_seconds)));
    let policy = webhooks::policy(&args.webhooks)?;
    let stop = drain::Stop::new();
    if args.webhooks.enabled {
        webhooks::start(&args, &policy, &view, presigner.clone(), &metrics, stop.stopped())?;
    }
    let inputs = match &args.input_url {
        Some(url) => {
            Some(InputImages::open(url, args.max_input_image_bytes).map_err(|source| ServeError::InputStore { url: url.clone(), source })?)
        }
        None => None,
    };
    let max_body_bytes = args.max_body_bytes + inputs.as_ref().map_or(0, InputImages::body_allowance);
    let state = Arc::new(AppState {
        keys_in_flight: Default::default(),
        inputs,
        max_body_bytes: args.max_body_bytes,
        body_limit: max_body_bytes,
        body_room: tokio::sync::Semaphore::new(crate::api::body_room_permits(args.body_bytes_in_flight, max_body_bytes)),
        webhooks: Some(policy),
        catalog,
        status: Some(view.store),
        control_topic: args.control_topic.clone(),
        presigner,
        view_caught_up: Some(view.caught_up),
        publisher,
        keys,
        lanes,
        metrics,
        publish_timeout: Duration::from_millis(args.publish.publish_timeout_ms),
        events_max: Duration::from_secs_f64(args.events_max_seconds.clamp(0.05, 86_400.0)),
        streams: Streams::new(args.events_max_streams, args.events_max_streams_per_tenant),
    });
    let listener = http::listen(&args, &state.metrics).await?;
    drain::serve(listener, crate::api::router(state, args.max_body_bytes), shutdown, stop).await
}

/// The API keys; none at all only when anonymous access was asked for by name.
fn api_keys(args: &ServeArgs) -> Result<ApiKeys, AuthError> {
    if args.allow_anonymous && args.api_keys.iter().all(|k| k.trim().is_empty()) {
        tracing::warn!("SLUICE_ALLOW_ANONYMOUS: the API is open and every task belongs to tenant `default`");
        Ok(ApiKeys::anonymous())
    } else {
        ApiKeys::parse(&args.api_keys)
    }
}

/// Starts measuring the workers' backlog ([`crate::backlog`]), unless its interval is 0.
fn start_backlog(args: &ServeArgs, metrics: &Metrics) -> Result<(), ServeError> {
    if args.backlog_interval_ms == 0 {
        return Ok(());
    }
    let settings = crate::backlog::Settings {
        group: args.worker_group.clone(),
        topics: args.publish.task_topics().names(),
        interval: Duration::from_millis(args.backlog_interval_ms),
    };
    crate::backlog::start(&args.publish.kafka, settings, metrics.clone()).map_err(ServeError::Backlog)
}
