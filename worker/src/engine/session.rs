//! An ONNX Runtime session as a [`Backend`]: CPU or CUDA execution provider, memory options.

use std::path::Path;

use ort::ep;
use ort::session::{RunOptions, Session, SessionInputValue};
use ort::value::TensorRef;

use super::{Backend, Call, EngineError, Runtime, Tensor, TensorData};

/// How a CUDA arena grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ArenaExtend {
    /// Grow by exactly the requested size: no memory reserved beyond what runs need.
    #[default]
    SameAsRequested,
    /// Grow by powers of two: fewer extensions, more memory held.
    NextPowerOfTwo,
}

/// cuDNN convolution algorithm search.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ConvSearch {
    /// Try every algorithm once per shape: fastest kernels, slow first run, more workspace.
    Exhaustive,
    /// cuDNN's heuristics: quick to start.
    #[default]
    Heuristic,
    /// The default algorithm, no search.
    Default,
}

/// Where sessions should run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda {
        device_id: i32,
        /// `gpu_mem_limit` of the CUDA arena, bytes.
        mem_limit: Option<usize>,
        arena_extend: ArenaExtend,
        conv_search: ConvSearch,
        /// TF32 tensor cores inside float32 convolutions and matrix products (`use_tf32`).
        tf32: bool,
        /// Deterministic kernels only (`use_deterministic_compute`).
        deterministic: bool,
        /// Fail instead of falling back to CPU when the CUDA provider can't be registered.
        require: bool,
    },
}

/// Session settings shared by every model of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionOptions {
    pub device: Device,
    /// Threads inside one operator; 0 lets ONNX Runtime choose (one per core).
    pub intra_threads: usize,
    /// Let ONNX Runtime's operator threads spin while waiting for work. Spinning shaves
    /// microseconds off each operator but burns a core per thread between runs, which the rest
    /// of the pipeline (encoding, uploads, the broker client) needs on a CPU node.
    pub spin: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            device: Device::Cpu,
            intra_threads: 0,
            spin: false,
        }
    }
}

/// Where a session ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Cpu,
    Cuda(i32),
}

impl Placement {
    /// The arena name ONNX Runtime's shrinkage run option expects.
    fn arena(self) -> String {
        match self {
            Placement::Cpu => "cpu:0".to_owned(),
            Placement::Cuda(id) => format!("gpu:{id}"),
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Cpu => f.write_str("cpu"),
            Placement::Cuda(id) => write!(f, "cuda:{id}"),
        }
    }
}

/// One ONNX Runtime session.
pub struct OrtBackend {
    session: Session,
    placement: Placement,
    shrink_next_run: bool,
    /// Inputs declared int32 (i64 tensors are narrowed for them), read once at load.
    int32_inputs: Vec<String>,
}

impl OrtBackend {
    /// Loads `path`. On CUDA, a provider that can't be registered falls back to CPU with a
    /// warning, unless the device requires it.
    pub fn load(runtime: &Runtime, path: &Path, options: &SessionOptions) -> Result<OrtBackend, EngineError> {
        if !path.is_file() {
            return Err(EngineError::Load(format!("model file {} does not exist", path.display())));
        }
        if let Device::Cuda {
            device_id,
            mem_limit,
            arena_extend,
            conv_search,
            tf32,
            deterministic: _,
            require,
        } = &options.device
        {
            let mut cuda = ep::CUDA::default()
                .with_device_id(*device_id)
                .with_arena_extend_strategy(match arena_extend {
                    ArenaExtend::SameAsRequested => ep::ArenaExtendStrategy::SameAsRequested,
                    ArenaExtend::NextPowerOfTwo => ep::ArenaExtendStrategy::NextPowerOfTwo,
                })
                .with_conv_algorithm_search(match conv_search {
                    ConvSearch::Exhaustive => ep::cuda::ConvAlgorithmSearch::Exhaustive,
                    ConvSearch::Heuristic => ep::cuda::ConvAlgorithmSearch::Heuristic,
                    ConvSearch::Default => ep::cuda::ConvAlgorithmSearch::Default,
                })
                .with_tf32(*tf32);
            if let Some(limit) = mem_limit {
                cuda = cuda.with_memory_limit(*limit);
            }
            match Self::build(runtime, path, options, Some(cuda.build().error_on_failure())) {
                Ok(session) => {
                    runtime.note_session(&session);
                    return Ok(OrtBackend::new(session, Placement::Cuda(*device_id)));
                }
                Err(e) if *require => return Err(EngineError::Load(format!("CUDA execution provider required but unavailable: {e}"))),
                Err(e) => tracing::warn!(error = %e, model = %path.display(), "CUDA execution provider unavailable; running on CPU"),
            }
        }
        let session = Self::build(runtime, path, options, None)?;
        runtime.note_session(&session);
        Ok(OrtBackend::new(session, Placement::Cpu))
    }

    fn new(session: Session, placement: Placement) -> OrtBackend {
        let mut backend = OrtBackend {
            session,
            placement,
            shrink_next_run: false,
            int32_inputs: Vec::new(),
        };
        backend.int32_inputs = backend
            .inputs()
            .into_iter()
            .filter(|i| i.kind == ElementKind::I32)
            .map(|i| i.name)
            .collect();
        backend
    }

    fn build(
        runtime: &Runtime,
        path: &Path,
        options: &SessionOptions,
        provider: Option<ep::ExecutionProviderDispatch>,
    ) -> Result<Session, EngineError> {
        let load = |e: &dyn std::fmt::Display| EngineError::Load(format!("{}: {e}", path.display()));
        let mut builder = Session::builder(runtime.environment()).map_err(|e| load(&e))?;
        builder = builder.with_intra_threads(options.intra_threads).map_err(|e| load(&e))?;
        let spin = if options.spin { "1" } else { "0" };
        builder = builder
            .with_config_entry("session.intra_op.allow_spinning", spin)
            .map_err(|e| load(&e))?;
        builder = builder
            .with_config_entry("session.inter_op.allow_spinning", spin)
            .map_err(|e| load(&e))?;
        if runtime.has_shared_cpu_arena() {
            // Allocate from the process-wide capped arena instead of a private one per session.
            builder = builder.with_env_allocators().map_err(|e| load(&e))?;
        }
        // No memory patterns: ONNX Runtime caches one per input shapes under a key that XORs
        // every dimension of every input (`SessionState::CalculateMemoryPatternsKey`), so a batch
        // dimension that two inputs share cancels out and every batch size gets the pattern of
        // the first size that ran; a run then pre-allocates that size's whole peak besides its
        // own tensors. Measured on the tiny SD model under a 400 MB arena: after pairs had run, a
        // single failed with the arena otherwise empty, and fit in a new session.
        builder = builder.with_memory_pattern(false).map_err(|e| load(&e))?;
        if let Device::Cuda { deterministic: true, .. } = options.device {
            builder = builder.with_deterministic_compute(true).map_err(|e| load(&e))?;
        }
        let mut providers = Vec::new();
        providers.extend(provider);
        providers.push(ep::CPU::default().with_arena_allocator(true).build());
        builder = builder.with_execution_providers(providers).map_err(|e| load(&e))?;
        builder.commit_from_file(path).map_err(|e| {
            let message = e.to_string();
            if super::is_out_of_memory(&message) {
                EngineError::OutOfMemory(message)
            } else {
                load(&e)
            }
        })
    }
}

/// Element type of a session input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementKind {
    F32,
    F16,
    I64,
    I32,
    Other,
}

/// What a session expects of one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputInfo {
    pub name: String,
    pub kind: ElementKind,
    /// Dimensions; -1 where dynamic.
    pub shape: Vec<i64>,
}

impl OrtBackend {
    /// The session's inputs, as the model declares them.
    pub fn inputs(&self) -> Vec<InputInfo> {
        use ort::value::TensorElementType as T;
        self.session
            .inputs()
            .iter()
            .map(|outlet| InputInfo {
                name: outlet.name().to_owned(),
                kind: match outlet.dtype().tensor_type() {
                    Some(T::Float32) => ElementKind::F32,
                    Some(T::Float16) => ElementKind::F16,
                    Some(T::Int64) => ElementKind::I64,
                    Some(T::Int32) => ElementKind::I32,
                    _ => ElementKind::Other,
                },
                shape: outlet
                    .dtype()
                    .tensor_shape()
                    .map(|s| s.iter().copied().collect())
                    .unwrap_or_default(),
            })
            .collect()
    }

    /// Runs the session on named tensors (f32 or i64; an i64 tensor goes in as int32 where the
    /// session's input is int32). Outputs are f32.
    pub fn run_tensors(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>, EngineError> {
        let narrowed: Vec<Option<Vec<i32>>> = inputs
            .iter()
            .map(|input| match &input.data {
                TensorData::I64(v) if self.int32_inputs.contains(&input.name) => Some(v.iter().map(|&x| x as i32).collect()),
                _ => None,
            })
            .collect();
        let mut values: Vec<(String, SessionInputValue<'_>)> = Vec::with_capacity(inputs.len());
        for (input, narrow) in inputs.iter().zip(&narrowed) {
            let shape = input.shape.clone();
            let value: SessionInputValue<'_> = match (&input.data, narrow) {
                (_, Some(v)) => TensorRef::from_array_view((shape, v.as_slice()))
                    .map_err(EngineError::from_run)?
                    .into(),
                (TensorData::F32(v), None) => TensorRef::from_array_view((shape, v.as_slice()))
                    .map_err(EngineError::from_run)?
                    .into(),
                (TensorData::I64(v), None) => TensorRef::from_array_view((shape, v.as_slice()))
                    .map_err(EngineError::from_run)?
                    .into(),
            };
            values.push((input.name.clone(), value));
        }
        let mut options = RunOptions::new().map_err(EngineError::from_run)?;
        if std::mem::take(&mut self.shrink_next_run) {
            options
                .set("memory.enable_memory_arena_shrinkage", self.placement.arena())
                .map_err(EngineError::from_run)?;
        }
        let outputs = self.session.run_with_options(values, &options).map_err(EngineError::from_run)?;
        let mut result = Vec::with_capacity(outputs.len());
        for (name, value) in outputs.iter() {
            let (shape, data) = value.try_extract_tensor::<f32>().map_err(EngineError::from_run)?;
            let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            result.push(Tensor::f32(name, shape, data.to_vec()));
        }
        Ok(result)
    }
}

impl Backend for OrtBackend {
    fn run(&mut self, call: &Call) -> Result<Vec<Tensor>, EngineError> {
        self.run_tensors(&call.inputs)
    }

    fn release_memory(&mut self) {
        self.shrink_next_run = true;
    }

    fn placement(&self) -> Placement {
        self.placement
    }
}
