//! Which models are loaded, and reloading them without leaking memory.
//!
//! A reload (admin endpoint or SIGHUP) stops taking batches for the model and waits for the ones
//! in flight, drops every session of the old model first, checks that the memory came back
//! (process RSS and arena; free device memory on CUDA) and that enough is free, then loads. If
//! the new model fails to load, the previous one is loaded again — from the very file it was
//! loaded from, held open, so replacing the file does not take the fallback away. If that fails
//! too, the worker exits non-zero so that the orchestrator starts a clean process: it never
//! keeps running in a state where it cannot serve.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use thiserror::Error;
use tokio::sync::{Mutex, RwLock, RwLockReadGuard, watch};

use futures::future::BoxFuture;

use crate::batching::adaptive::{CleanArena, Cleaned};
use crate::engine::{ArenaStats, Device, Engine, EngineError, Loader, Placement, Runtime, SessionOptions};
use crate::events::{Emit, ModelLoaded, ReloadEnded};
use crate::metrics::{self, Metrics};
use crate::models::{ModelAdapter, Registry};

/// What `/readyz` and `/healthz` report.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Health {
    pub models_loaded: bool,
    pub reloading: u32,
    pub consuming: bool,
    pub shutting_down: bool,
    pub fatal: Option<String>,
}

impl Health {
    pub fn ready(&self) -> bool {
        self.models_loaded && self.reloading == 0 && self.consuming && !self.shutting_down && self.fatal.is_none()
    }
}

#[derive(Debug, Error)]
pub enum ServingError {
    #[error("model {0:?} is not served by this worker (SLUICE_MODELS)")]
    UnknownModel(String),
    #[error("no adapter for model {0:?}: this worker knows {1:?}")]
    NoAdapter(String, Vec<String>),
    #[error("model {name}: {path} does not exist")]
    MissingFile { name: String, path: String },
    #[error("model {name}: {source}")]
    Load { name: String, source: EngineError },
    /// A reload option out of its bounds; nothing was changed.
    #[error("{field}: {message}")]
    InvalidOption { field: &'static str, message: String },
    /// The worker can no longer serve and must be restarted.
    #[error("fatal: {0}")]
    Fatal(String),
}

/// Memory figures around a reload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemorySnapshot {
    pub rss_bytes: u64,
    pub arena_allocated_bytes: Option<u64>,
    pub arena_in_use_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
    pub device_free_bytes: Option<u64>,
    /// Device memory this process holds (NVML's process list; `None` where it does not list
    /// this process, e.g. in a container with its own pid namespace).
    pub device_process_bytes: Option<u64>,
}

/// How a reload ended, when the worker can still serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReloadResult {
    /// The new model is loaded.
    Reloaded,
    /// The new model failed to load; the previous one was loaded again.
    FellBack,
}

impl ReloadResult {
    fn as_str(self) -> &'static str {
        match self {
            ReloadResult::Reloaded => "reloaded",
            ReloadResult::FellBack => "fell_back",
        }
    }
}

/// What a reload did.
#[derive(Debug, Clone, Serialize)]
pub struct ReloadReport {
    pub model: String,
    pub result: ReloadResult,
    pub error: Option<String>,
    pub placement: String,
    pub before: MemorySnapshot,
    pub after_unload: MemorySnapshot,
    pub after: MemorySnapshot,
    pub drain_ms: u64,
    pub total_ms: u64,
}

/// Per-reload changes of the session options.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct ReloadOverrides {
    pub intra_threads: Option<usize>,
    pub gpu_mem_limit: Option<usize>,
}

/// The bounds every reload holds to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReloadLimits {
    /// Free memory required before the new model loads (available system memory on CPU, free
    /// device memory on CUDA).
    pub min_free_bytes: u64,
    /// How much more memory may be in use right after a model is unloaded than right after its
    /// first unload: on CUDA the device memory this process holds (NVML's process list), or the
    /// whole device's in use where NVML does not list the process; the process's RSS on CPU.
    /// More means a reload leaks (seed 001's crash loop: each reload keeping the old weights on
    /// the device until OOM), and the worker exits non-zero for a clean restart instead of
    /// serving on until it runs out.
    pub leak_bound_bytes: u64,
}

/// The smallest CUDA arena a reload may ask for: below it no model loads, and the fallback
/// would have nothing to fall back to.
pub const MIN_GPU_MEM_LIMIT: usize = 256 << 20;

impl ReloadOverrides {
    /// `base` with these changes, or the first one out of bounds: `intra_threads` at most four
    /// per core (0: ONNX Runtime's choice), `gpu_mem_limit` on CUDA workers only and at least
    /// [`MIN_GPU_MEM_LIMIT`].
    pub fn apply(&self, base: &SessionOptions) -> Result<SessionOptions, ServingError> {
        let mut options = base.clone();
        if let Some(t) = self.intra_threads {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            if t > 4 * cores {
                return Err(ServingError::InvalidOption {
                    field: "intra_threads",
                    message: format!("{t} is more than 4 per core ({cores} cores); 0 lets ONNX Runtime choose"),
                });
            }
            options.intra_threads = t;
        }
        if let Some(limit) = self.gpu_mem_limit {
            let Device::Cuda { mem_limit, .. } = &mut options.device else {
                return Err(ServingError::InvalidOption {
                    field: "gpu_mem_limit",
                    message: "this worker runs on CPU; gpu_mem_limit applies to CUDA workers".into(),
                });
            };
            if limit < MIN_GPU_MEM_LIMIT {
                return Err(ServingError::InvalidOption {
                    field: "gpu_mem_limit",
                    message: format!("{limit} bytes is below the minimum of {MIN_GPU_MEM_LIMIT}"),
                });
            }
            *mem_limit = Some(limit);
        }
        Ok(options)
    }
}

struct Loaded {
    /// The file the current sessions were loaded from, held open for the fallback.
    file: File,
    /// The options they were loaded with: the fallback's, whatever a failed reload asked for.
    options: SessionOptions,
    placement: Placement,
    /// False once a reload failed for good: nothing may run on a model that is not loaded.
    serving: bool,
}

struct Served {
    adapter: Arc<dyn ModelAdapter>,
    path: PathBuf,
    state: RwLock<Loaded>,
}

pub struct Serving {
    engine: Engine,
    /// The ONNX Runtime whose CPU arena a reload resets and whose statistics the gauges read;
    /// `None` for backends that don't run on it.
    runtime: Option<Arc<Runtime>>,
    models: HashMap<String, Served>,
    options: Mutex<SessionOptions>,
    metrics: Metrics,
    health: watch::Sender<Health>,
    limits: ReloadLimits,
    /// Memory in use right after each model's first unload (see [`ReloadLimits`]).
    unload_baselines: std::sync::Mutex<HashMap<String, u64>>,
    /// Held while sessions are dropped and loaded (a reload's swap, a clean-arena rebuild), so
    /// that one never sees the other's half-done work.
    sessions: Mutex<()>,
    /// Bytes the shared CPU arena held right after the models were loaded, before any run.
    arena_baseline: std::sync::Mutex<Option<u64>>,
}

/// A held model: batches run while one of these is alive; a reload waits for all of them.
pub struct ModelGuard<'a> {
    _guard: RwLockReadGuard<'a, Loaded>,
}

impl Serving {
    /// Loads every model (name, directory). Any failure is a startup error naming the model
    /// and the file.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn start(
        engine: Engine,
        runtime: Option<Arc<Runtime>>,
        registry: &Registry,
        served: &[(String, PathBuf)],
        options: SessionOptions,
        metrics: Metrics,
        health: watch::Sender<Health>,
        limits: ReloadLimits,
    ) -> Result<Serving, ServingError> {
        let mut models = HashMap::new();
        for (name, dir) in served {
            let adapter = registry
                .get(name)
                .ok_or_else(|| ServingError::NoAdapter(name.clone(), registry.names()))?;
            let path = adapter.entry().map_or_else(|| dir.clone(), |entry| dir.join(entry));
            let file = File::open(&path).map_err(|_| ServingError::MissingFile {
                name: name.clone(),
                path: path.display().to_string(),
            })?;
            let placement = engine
                .load(name, loader(&adapter, fd_path(&file), options.clone()))
                .await
                .map_err(|source| ServingError::Load {
                    name: name.clone(),
                    source,
                })?;
            tracing::info!(model = %name, path = %path.display(), %placement, "model loaded");
            ModelLoaded { model: name, loaded: true }.emit(&metrics);
            models.insert(
                name.clone(),
                Served {
                    adapter,
                    path,
                    state: RwLock::new(Loaded {
                        file,
                        options: options.clone(),
                        placement,
                        serving: true,
                    }),
                },
            );
        }
        health.send_modify(|h| h.models_loaded = true);
        let arena_baseline = runtime.as_ref().and_then(|r| r.cpu_arena_stats()).map(|a| a.total_allocated);
        Ok(Serving {
            engine,
            runtime,
            models,
            options: Mutex::new(options),
            metrics,
            health,
            limits,
            unload_baselines: std::sync::Mutex::new(HashMap::new()),
            sessions: Mutex::new(()),
            arena_baseline: std::sync::Mutex::new(arena_baseline),
        })
    }

    pub fn adapter(&self, model: &str) -> Option<Arc<dyn ModelAdapter>> {
        self.models.get(model).map(|s| s.adapter.clone())
    }

    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<_> = self.models.keys().cloned().collect();
        v.sort();
        v
    }

    /// Holds `model` for one batch; `None` when it is not served (a reload failed for good and
    /// the worker is about to exit: the batch must be left unacknowledged, not failed).
    pub async fn hold(&self, model: &str) -> Option<ModelGuard<'_>> {
        let guard = self.models.get(model)?.state.read().await;
        guard.serving.then_some(ModelGuard { _guard: guard })
    }

    /// Statistics of the shared CPU arena, when there is one.
    pub(crate) fn arena_stats(&self) -> Option<ArenaStats> {
        self.runtime.as_ref()?.cpu_arena_stats()
    }

    /// The memory figures now. The device's are those of `placement` (the model being reloaded,
    /// whose state the caller holds locked), else of any model on CUDA whose state is not locked.
    fn snapshot(&self, placement: Option<Placement>) -> MemorySnapshot {
        let arena = self.arena_stats();
        let device = match placement {
            Some(Placement::Cuda(id)) => Some(id),
            Some(Placement::Cpu) => None,
            None => self.models.values().find_map(|s| match s.state.try_read().ok()?.placement {
                Placement::Cuda(id) => Some(id),
                Placement::Cpu => None,
            }),
        };
        MemorySnapshot {
            rss_bytes: metrics::rss_bytes(),
            arena_allocated_bytes: arena.map(|a| a.total_allocated),
            arena_in_use_bytes: arena.map(|a| a.in_use),
            available_bytes: metrics::available_memory_bytes(),
            device_free_bytes: device.and_then(crate::engine::gpu::device_memory).map(|(free, _)| free),
            device_process_bytes: device.and_then(|id| crate::engine::gpu::process_memory(id, std::process::id())),
        }
    }

    /// Reloads `model`, or every model. See the module documentation.
    pub async fn reload(&self, model: Option<&str>, overrides: ReloadOverrides) -> Result<Vec<ReloadReport>, ServingError> {
        let names: Vec<String> = match model {
            Some(m) if !self.models.contains_key(m) => return Err(ServingError::UnknownModel(m.to_owned())),
            Some(m) => vec![m.to_owned()],
            None => self.names(),
        };
        // Later reloads start from these options only if every model loaded with them.
        let mut base = self.options.lock().await;
        let options = overrides.apply(&base)?;
        let mut reports = Vec::new();
        for name in names {
            self.health.send_modify(|h| h.reloading += 1);
            let report = self.reload_one(&name, &options).await;
            self.health.send_modify(|h| h.reloading -= 1);
            match report {
                Ok(report) => reports.push(report),
                Err(e) => {
                    ReloadEnded {
                        model: &name,
                        result: "fatal",
                    }
                    .emit(&self.metrics);
                    ModelLoaded {
                        model: &name,
                        loaded: false,
                    }
                    .emit(&self.metrics);
                    self.health.send_modify(|h| h.fatal = Some(e.to_string()));
                    return Err(e);
                }
            }
        }
        if reports.iter().all(|r| r.result == ReloadResult::Reloaded) {
            *base = options;
        }
        Ok(reports)
    }

    async fn reload_one(&self, name: &str, options: &SessionOptions) -> Result<ReloadReport, ServingError> {
        let served = &self.models[name];
        let started = Instant::now();
        // Stop taking batches for this model; wait for those in flight.
        let mut state = served.state.write().await;
        let _sessions = self.sessions.lock().await;
        let result = self.swap(name, served, &mut state, options, started).await;
        if result.is_err() {
            state.serving = false;
        }
        result
    }

    /// Drops every session of `name` and checks that the memory came back (the process's
    /// available memory on CPU, the device's free memory on CUDA): what is free after the unload.
    async fn unload_checked(&self, name: &str, state: &Loaded) -> Result<MemorySnapshot, ServingError> {
        self.engine.unload(name).await;
        ModelLoaded {
            model: name,
            loaded: false,
        }
        .emit(&self.metrics);
        if let (1, Some(runtime)) = (self.models.len(), &self.runtime) {
            // No session is left anywhere: give the whole arena back, then the freed heap.
            if let Err(e) = runtime.reset_cpu_arena() {
                return Err(ServingError::Fatal(format!("resetting the CPU arena failed: {e}")));
            }
        }
        // SAFETY: malloc_trim only returns free heap pages to the system.
        unsafe { libc::malloc_trim(0) };
        let after_unload = self.snapshot(Some(state.placement));
        let free = match state.placement {
            Placement::Cuda(_) => after_unload.device_free_bytes,
            Placement::Cpu => after_unload.available_bytes,
        };
        if let Some(free) = free.filter(|f| *f < self.limits.min_free_bytes) {
            return Err(ServingError::Fatal(format!(
                "only {free} bytes free after dropping {name} (need {}): memory did not come back; restarting clean",
                self.limits.min_free_bytes
            )));
        }
        self.check_leak(name, state.placement, &after_unload)?;

        Ok(after_unload)
    }

    /// Compares the memory in use right after unloading `name` with what it was after its first
    /// unload: more than [`ReloadLimits::leak_bound_bytes`] above it is a leak, and fatal.
    fn check_leak(&self, name: &str, placement: Placement, after_unload: &MemorySnapshot) -> Result<(), ServingError> {
        // On CUDA, this process's device memory where NVML lists it; else what the whole device
        // has in use, which other processes on the same GPU move too.
        let (in_use, what) = match (placement, after_unload.device_process_bytes) {
            (Placement::Cuda(_), Some(bytes)) => (Some(bytes), "this process's device memory"),
            (Placement::Cuda(id), None) => (
                crate::engine::gpu::device_memory(id).map(|(free, total)| total.saturating_sub(free)),
                "device memory in use (the whole device)",
            ),
            (Placement::Cpu, _) => (Some(after_unload.rss_bytes), "RSS"),
        };
        let Some(in_use) = in_use else { return Ok(()) };
        let baseline = *self
            .unload_baselines
            .lock()
            .expect("baselines")
            .entry(name.to_owned())
            .or_insert(in_use);
        tracing::debug!(model = name, in_use, baseline, what, "memory after the unload");
        if in_use > baseline + self.limits.leak_bound_bytes {
            return Err(ServingError::Fatal(format!(
                "{what} after dropping {name} is {in_use} bytes, {} more than after its first unload ({baseline}); \
                 the bound is {} (SLUICE_RELOAD_LEAK_BOUND_BYTES): reloads leak, restarting clean",
                in_use - baseline,
                self.limits.leak_bound_bytes
            )));
        }
        Ok(())
    }

    /// Loads the model's file as it is now; if that fails, the previous version again, from the
    /// very file it was loaded from (held open). Fatal if both fail.
    async fn load_new_or_previous(
        &self,
        name: &str,
        served: &Served,
        state: &mut Loaded,
        options: &SessionOptions,
    ) -> Result<(ReloadResult, Option<String>), ServingError> {
        let new_file = File::open(&served.path);
        let attempt = match &new_file {
            Ok(file) => {
                self.engine
                    .load(name, loader(&served.adapter, fd_path(file), options.clone()))
                    .await
            }
            Err(e) => Err(EngineError::Load(format!("{}: {e}", served.path.display()))),
        }
        // ORT names the file by the descriptor it was read through; name the model's path.
        .map_err(|e| match e {
            EngineError::Load(message) if new_file.is_ok() => EngineError::Load(message.replace(
                &fd_path(new_file.as_ref().expect("checked")).display().to_string(),
                &served.path.display().to_string(),
            )),
            e => e,
        });
        Ok(match attempt {
            Ok(placement) => {
                *state = Loaded {
                    file: new_file.expect("opened"),
                    options: options.clone(),
                    placement,
                    serving: true,
                };
                (ReloadResult::Reloaded, None)
            }
            Err(error) => {
                tracing::warn!(model = name, error = %error, "new model failed to load; loading the previous one");
                match self
                    .engine
                    .load(name, loader(&served.adapter, fd_path(&state.file), state.options.clone()))
                    .await
                {
                    Ok(placement) => {
                        state.placement = placement;
                        (ReloadResult::FellBack, Some(error.to_string()))
                    }
                    Err(fallback) => {
                        return Err(ServingError::Fatal(format!(
                            "model {name}: new version failed ({error}) and the previous one failed too ({fallback})"
                        )));
                    }
                }
            }
        })
    }

    /// One reload, once the model's calls have drained: unload, check the memory came back, load
    /// the new version (or the previous one), and report the memory at each point.
    async fn swap(
        &self,
        name: &str,
        served: &Served,
        state: &mut Loaded,
        options: &SessionOptions,
        started: Instant,
    ) -> Result<ReloadReport, ServingError> {
        let drain_ms = started.elapsed().as_millis() as u64;
        let before = self.snapshot(None);

        let after_unload = self.unload_checked(name, state).await?;
        let (result, error) = self.load_new_or_previous(name, served, state, options).await?;
        ModelLoaded { model: name, loaded: true }.emit(&self.metrics);
        *self.arena_baseline.lock().expect("baseline") = self.arena_stats().map(|a| a.total_allocated);
        ReloadEnded {
            model: name,
            result: result.as_str(),
        }
        .emit(&self.metrics);
        let after = self.snapshot(Some(state.placement));
        let report = ReloadReport {
            model: name.to_owned(),
            result,
            error,
            placement: state.placement.to_string(),
            before,
            after_unload,
            after,
            drain_ms,
            total_ms: started.elapsed().as_millis() as u64,
        };
        tracing::info!(
            model = name,
            result = result.as_str(),
            rss_before = before.rss_bytes,
            rss_after_unload = after_unload.rss_bytes,
            rss_after = after.rss_bytes,
            arena_after_unload = ?after_unload.arena_allocated_bytes,
            device_free_after_unload = ?after_unload.device_free_bytes,
            ms = report.total_ms,
            "model reloaded"
        );
        Ok(report)
    }

    /// Rebuilds every model's sessions on a clean arena (see [`Engine::rebuild`]): nothing that
    /// failed runs left behind stays. A model that cannot be loaded again makes the worker
    /// unable to serve: reported as fatal, as a failed reload is.
    pub async fn clean_arena(&self) -> Result<Cleaned, ServingError> {
        let _sessions = self.sessions.lock().await;
        let before = self.arena_stats().map(|a| a.total_allocated);
        let runtime = self.runtime.clone();
        let rebuilt = self
            .engine
            .rebuild(|| {
                if let Some(runtime) = &runtime {
                    runtime.reset_cpu_arena()?;
                }
                // SAFETY: malloc_trim only returns free heap pages to the system.
                unsafe { libc::malloc_trim(0) };
                Ok(())
            })
            .await;
        if let Err(e) = rebuilt {
            let e = ServingError::Fatal(format!("rebuilding the sessions on a clean arena failed: {e}"));
            self.health.send_modify(|h| h.fatal = Some(e.to_string()));
            return Err(e);
        }
        Ok(Cleaned {
            before,
            after: self.arena_stats().map(|a| a.total_allocated),
            baseline: *self.arena_baseline.lock().expect("baseline"),
        })
    }
}

/// The worker's clean arena for the adaptive batcher: a failed rebuild stops the worker.
pub(crate) struct Rebuild {
    pub serving: Arc<Serving>,
    pub fatal: tokio_util::sync::CancellationToken,
}

impl CleanArena for Rebuild {
    fn clean(&self) -> BoxFuture<'_, Result<Cleaned, EngineError>> {
        Box::pin(async move {
            self.serving.clean_arena().await.map_err(|e| {
                tracing::error!(error = %e, "the worker cannot serve and exits");
                self.fatal.cancel();
                EngineError::Stopped
            })
        })
    }
}

/// The path through which a held file is read again, whatever happened to its name since.
fn fd_path(file: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

fn loader(adapter: &Arc<dyn ModelAdapter>, path: PathBuf, options: SessionOptions) -> Loader {
    let adapter = adapter.clone();
    Arc::new(move || adapter.load(&path, &options))
}
