//! What can go wrong in the engine, with out-of-memory told apart from everything else.

use thiserror::Error;

/// An engine failure. Only [`EngineError::OutOfMemory`] makes the adaptive batcher halve a batch;
/// every other error is about the model or its inputs and is never retried at a smaller size for
/// memory's sake.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// The device (or CPU arena) could not hold the batch.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// The model rejected or failed on these inputs.
    #[error("model run failed: {0}")]
    Run(String),
    /// A model could not be loaded.
    #[error("model load failed: {0}")]
    Load(String),
    /// ONNX Runtime itself is unusable (missing or incompatible library).
    #[error("ONNX Runtime unavailable: {0}")]
    Runtime(String),
    /// Model code panicked on these inputs (a bug, isolated to the task that triggers it).
    #[error("model code {0}")]
    Panicked(String),
    /// The engine is shutting down or its thread is gone.
    #[error("engine stopped")]
    Stopped,
}

/// Substrings that ONNX Runtime and CUDA use for allocation failures. Matched case-insensitively
/// against the whole error text, which carries the failing allocator's own message:
/// - BFC arena (CPU and CUDA): `Available memory of X is smaller than requested bytes of Y`,
///   `Failed to allocate memory for requested buffer of size`;
/// - CUDA: `CUDA out of memory`, `cudaErrorMemoryAllocation`, `CUDA failure 2: out of memory`,
///   cuBLAS / cuDNN `..._ALLOC_FAILED`;
/// - the C++ runtime: `std::bad_alloc`.
const OOM_MARKERS: [&str; 8] = [
    "is smaller than requested bytes",
    "failed to allocate memory",
    "out of memory",
    "cudaerrormemoryallocation",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "bad_alloc",
    "bfcarena::allocaterawinternal",
];

/// True when `message` is an allocation failure.
pub(crate) fn is_out_of_memory(message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    OOM_MARKERS.iter().any(|m| lower.contains(m))
}

impl EngineError {
    /// Classifies an error from a model run.
    pub fn from_run(error: impl std::fmt::Display) -> EngineError {
        let message = error.to_string();
        if is_out_of_memory(&message) {
            EngineError::OutOfMemory(message)
        } else {
            EngineError::Run(message)
        }
    }

    pub fn is_oom(&self) -> bool {
        matches!(self, EngineError::OutOfMemory(_))
    }

    /// Whether the error belongs to the inputs of the call (a model error or a panic): inside a
    /// batch it is isolated by bisection, and the task that triggers it fails on its own.
    pub fn is_task_error(&self) -> bool {
        matches!(self, EngineError::Run(_) | EngineError::Panicked(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_allocation_failures_from_each_source() {
        for message in [
            "Non-zero status code returned while running Conv node. Name:'/down.0/Conv' Status Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:359 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Available memory of 1048576 is smaller than requested bytes of 4194304",
            "Failed to allocate memory for requested buffer of size 67108864",
            "CUDA error cudaErrorMemoryAllocation:out of memory",
            "CUDA failure 2: out of memory ; GPU=0 ; hostname=x",
            "CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED",
            "std::bad_alloc",
        ] {
            assert!(EngineError::from_run(message).is_oom(), "{message}");
        }
    }

    #[test]
    fn other_failures_are_not_oom() {
        for message in [
            "Got invalid dimensions for input: noisy for the following indices index: 2 Got: 64 Expected: 128",
            "Unexpected input data type. Actual: (tensor(double)) , expected: (tensor(float))",
            "Load model from /m.onnx failed: Protobuf parsing failed.",
        ] {
            assert!(!EngineError::from_run(message).is_oom(), "{message}");
        }
    }
}
