//! Starting role one: the models. Resolves which models this worker serves from the catalog,
//! builds their adapters (ONNX Runtime, or the caller's own through [`Models::Custom`]), wraps
//! them in test faults when asked, and loads them on the engine threads.

use std::path::PathBuf;
use std::sync::Arc;

use sluice_schemas::Catalog;
use tokio::sync::watch;

use super::{Models, StartError};
use crate::config::{Config, EngineArgs};
use crate::engine::{Engine, Runtime};
use crate::metrics::Metrics;
use crate::models::Registry;
use crate::models::serving::{Health, ReloadLimits, Serving};
use crate::storage::images::ImageStore;
use crate::testing::faults::Faults;

/// The loaded models and what serves them.
pub(super) struct Loaded {
    pub catalog: Arc<Catalog>,
    pub engine: Engine,
    pub serving: Arc<Serving>,
    /// The worker's health, as the probes report it.
    pub health: watch::Sender<Health>,
    /// Where images and result manifests go.
    pub images: ImageStore,
    /// Where input images are read from, when configured.
    pub inputs: Option<ImageStore>,
}

pub(super) async fn load(config: &Config, models: Models, metrics: &Metrics) -> Result<Loaded, StartError> {
    let e = &config.engine;
    let catalog = Arc::new(Catalog::load(e.model_catalog.as_deref())?);
    let served = served(&catalog, e)?;
    let (registry, runtime) = match models {
        Models::Onnx => {
            let runtime = Arc::new(Runtime::init(&e.device.runtime_options())?);
            (
                Registry::from_catalog(runtime.clone(), &catalog, &served).map_err(StartError::Model)?,
                Some(runtime),
            )
        }
        Models::Custom(registry) => (registry, None),
    };
    let faults = Arc::new(Faults::parse(&config.test_faults).map_err(StartError::Faults)?);
    let registry = if faults.is_empty() {
        registry
    } else {
        tracing::warn!(?faults, "test fault injection is on (SLUICE_TEST_FAULTS): never in production");
        registry.map(|adapter| faults.inject(adapter))
    };
    let engine = Engine::start_with_kept(e.engine_slots, e.interactive_slots);
    let (health, _) = watch::channel(Health::default());
    let serving = Arc::new(
        Serving::start(
            engine.clone(),
            runtime,
            &registry,
            &served,
            e.device.session_options(),
            metrics.clone(),
            health.clone(),
            ReloadLimits {
                min_free_bytes: e.reload_min_free_bytes,
                leak_bound_bytes: e.reload_leak_bound_bytes,
            },
        )
        .await?,
    );
    let images = ImageStore::from_url(&config.storage.output_url)?.with_concurrency(config.storage.storage_concurrency);
    let inputs = match &config.storage.input_url {
        Some(url) => Some(ImageStore::from_url(url)?.with_concurrency(config.storage.storage_concurrency)),
        None => None,
    };
    Ok(Loaded {
        catalog,
        engine,
        serving,
        health,
        images,
        inputs,
    })
}

/// The models to serve, with their directories: `SLUICE_MODELS`, or every model of the catalog.
fn served(catalog: &Catalog, e: &EngineArgs) -> Result<Vec<(String, PathBuf)>, StartError> {
    let names: Vec<String> = if e.models.is_empty() {
        catalog.names().into_iter().map(str::to_owned).collect()
    } else {
        e.models.clone()
    };
    names
        .into_iter()
        .map(|name| {
            let entry = catalog.get(&name).ok_or_else(|| {
                StartError::Model(format!(
                    "SLUICE_MODELS names {name}, which the model catalog does not list (it lists: {})",
                    catalog.names().join(", ")
                ))
            })?;
            let dir = entry.dir(&e.model_dir);
            Ok((name, dir))
        })
        .collect()
}
