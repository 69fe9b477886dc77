//! The process-wide ONNX Runtime: loading the library, the shared CPU arena, memory statistics.

use std::ffi::{CStr, c_char};
use std::path::PathBuf;
use std::ptr;
use std::sync::{Arc, Mutex};

use ort::AsPointer;
use ort::environment::Environment;
use ort::logging::LogLevel;
use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::Session;

use super::error::EngineError;

/// Settings of the process-wide runtime.
#[derive(Debug, Clone, Default)]
pub struct RuntimeOptions {
    /// Path of `libonnxruntime.so`; `None` uses `ORT_DYLIB_PATH`.
    pub dylib_path: Option<PathBuf>,
    /// Cap of the shared CPU arena in bytes. When set, every session allocates from one BFC arena
    /// of this size, so a batch that does not fit fails with a real allocation error (this is how
    /// the tests make genuine OOMs on CPU).
    pub cpu_arena_max_bytes: Option<usize>,
}

/// The loaded runtime. There is one per process (ONNX Runtime allows one environment).
pub struct Runtime {
    env: Environment,
    cpu_arena: Option<MemoryInfo<'static>>,
    /// An allocator handle on the shared CPU arena, taken from the first session that uses it:
    /// ONNX Runtime reports arena statistics through session allocators only. It keeps the arena
    /// alive, so it is dropped before the arena is reset.
    arena_handle: Mutex<Option<Allocator>>,
    cpu_arena_max_bytes: Option<usize>,
    dylib_path: PathBuf,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("dylib_path", &self.dylib_path)
            .field("cpu_arena_max_bytes", &self.cpu_arena_max_bytes)
            .finish()
    }
}

/// Memory figures of one allocator, as ONNX Runtime reports them (bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    pub limit: u64,
    pub in_use: u64,
    pub total_allocated: u64,
    pub max_in_use: u64,
}

impl Runtime {
    /// Loads ONNX Runtime. A missing or incompatible library is an error that says which file and
    /// what to do, never a panic.
    pub fn init(options: &RuntimeOptions) -> Result<Runtime, EngineError> {
        let path = match &options.dylib_path {
            Some(p) => p.clone(),
            None => std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from).ok_or_else(|| {
                EngineError::Runtime(
                    "no ONNX Runtime library given: set ORT_DYLIB_PATH (or --ort-dylib-path) to libonnxruntime.so; `make assets` fetches one".into(),
                )
            })?,
        };
        if !path.is_file() {
            return Err(EngineError::Runtime(format!(
                "ONNX Runtime library {} does not exist; `make assets` fetches it",
                path.display()
            )));
        }
        let builder = ort::init_from(&path).map_err(|e| EngineError::Runtime(format!("cannot load {}: {e}", path.display())))?;
        // `ort` panics when the library is older than the API it was built for; turn that into an error.
        let env = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            builder
                .with_name("sluice")
                .with_telemetry(false)
                .with_logger(Arc::new(forward_log))
                .build()
        }))
        .map_err(|_| {
            EngineError::Runtime(format!(
                "{} is not a compatible ONNX Runtime (this build needs API 24, ONNX Runtime >= 1.24)",
                path.display()
            ))
        })?
        .map_err(|e| EngineError::Runtime(format!("cannot create the ONNX Runtime environment: {e}")))?;

        let mut runtime = Runtime {
            env,
            cpu_arena: None,
            arena_handle: Mutex::new(None),
            cpu_arena_max_bytes: options.cpu_arena_max_bytes,
            dylib_path: path,
        };
        if let Some(cap) = options.cpu_arena_max_bytes {
            runtime.register_cpu_arena(cap)?;
        }
        Ok(runtime)
    }

    pub fn environment(&self) -> &Environment {
        &self.env
    }

    /// True when sessions should allocate from the shared, capped CPU arena.
    pub fn has_shared_cpu_arena(&self) -> bool {
        self.cpu_arena.is_some()
    }

    pub fn cpu_arena_max_bytes(&self) -> Option<usize> {
        self.cpu_arena_max_bytes
    }

    fn register_cpu_arena(&mut self, cap: usize) -> Result<(), EngineError> {
        let info = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Arena, MemoryType::Default)
            .map_err(|e| EngineError::Runtime(format!("CPU memory info: {e}")))?;
        register_arena(&self.env, &info, cap)?;
        self.cpu_arena = Some(info);
        Ok(())
    }

    /// Remembers an allocator handle on the shared arena, for statistics (see `arena_handle`).
    pub(super) fn note_session(&self, session: &Session) {
        let Some(info) = &self.cpu_arena else { return };
        let mut handle = self.arena_handle.lock().expect("arena handle");
        if handle.is_none() {
            *handle = Allocator::new(session, info.clone()).ok();
        }
    }

    /// Replaces the shared CPU arena by a new, empty one, returning every byte the old one held
    /// to the system. Only safe when no session exists: the engine calls it during a reload,
    /// after every session has been dropped. Returns whether an arena was reset.
    pub fn reset_cpu_arena(&self) -> Result<bool, EngineError> {
        let (Some(info), Some(cap)) = (&self.cpu_arena, self.cpu_arena_max_bytes) else {
            return Ok(false);
        };
        self.arena_handle.lock().expect("arena handle").take();
        let api = ort::api();
        unsafe { check((api.UnregisterAllocator)(self.env.ptr().cast_mut(), info.ptr()))? };
        register_arena(&self.env, info, cap)?;
        Ok(true)
    }

    /// Statistics of the shared CPU arena, once a session has used it.
    pub fn cpu_arena_stats(&self) -> Option<ArenaStats> {
        let handle = self.arena_handle.lock().expect("arena handle");
        let allocator = handle.as_ref()?;
        let api = ort::api();
        unsafe {
            let mut kvps = ptr::null_mut();
            check((api.AllocatorGetStats)(allocator.ptr(), &mut kvps)).ok()?;
            let get = |key: &CStr| -> u64 {
                let v = (api.GetKeyValue)(kvps, key.as_ptr());
                if v.is_null() {
                    0
                } else {
                    CStr::from_ptr(v).to_str().ok().and_then(|s| s.parse().ok()).unwrap_or(0)
                }
            };
            let stats = ArenaStats {
                limit: get(c"Limit"),
                in_use: get(c"InUse"),
                total_allocated: get(c"TotalAllocated"),
                max_in_use: get(c"MaxInUse"),
            };
            (api.ReleaseKeyValuePairs)(kvps);
            Some(stats)
        }
    }
}

fn register_arena(env: &Environment, info: &MemoryInfo<'_>, cap: usize) -> Result<(), EngineError> {
    let api = ort::api();
    let keys: [*const c_char; 2] = [c"max_mem".as_ptr(), c"arena_extend_strategy".as_ptr()];
    // arena_extend_strategy 1 = kSameAsRequested: grow by exactly what is asked, so the cap is
    // reached by real requests rather than by a doubling step.
    let values: [usize; 2] = [cap, 1];
    let mut cfg = ptr::null_mut();
    unsafe {
        check((api.CreateArenaCfgV2)(keys.as_ptr(), values.as_ptr(), keys.len(), &mut cfg))?;
        let status = (api.CreateAndRegisterAllocator)(env.ptr().cast_mut(), info.ptr(), cfg);
        (api.ReleaseArenaCfg)(cfg);
        check(status)
    }
}

/// ONNX Runtime's own log lines, through `tracing`. Its errors come back to us as statuses too,
/// where they are logged with their context and at the level they deserve (a handled OOM is a
/// WARN, never an ERROR), so here they are only debug output.
fn forward_log(level: LogLevel, category: &str, _id: &str, location: &str, message: &str) {
    match level {
        LogLevel::Verbose => tracing::trace!(target: "onnxruntime", category, location, "{message}"),
        LogLevel::Info => tracing::debug!(target: "onnxruntime", category, location, "{message}"),
        LogLevel::Warning => tracing::warn!(target: "onnxruntime", category, location, "{message}"),
        LogLevel::Error | LogLevel::Fatal => tracing::debug!(target: "onnxruntime", category, location, "{message}"),
    }
}

/// Converts an `OrtStatus` into a result, releasing it.
unsafe fn check(status: ort::sys::OrtStatusPtr) -> Result<(), EngineError> {
    let status: *mut ort::sys::OrtStatus = status.0;
    if status.is_null() {
        return Ok(());
    }
    let api = ort::api();
    let message = unsafe {
        let text = (api.GetErrorMessage)(status);
        let message = if text.is_null() {
            "unknown error".to_owned()
        } else {
            CStr::from_ptr(text).to_string_lossy().into_owned()
        };
        (api.ReleaseStatus)(status);
        message
    };
    Err(EngineError::Runtime(message))
}

// SAFETY: the environment is reference-counted and thread-safe in ONNX Runtime; the CPU memory
// info is created once, never mutated, and only read (passed by const pointer) afterwards.
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}
