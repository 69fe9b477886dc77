//! Free device memory, read through NVML (`libnvidia-ml.so.1`, shipped with the driver). NVML
//! reports what the whole device has free, CUDA contexts and other processes included — the
//! figure that decides whether a reload can load again. Loaded at run time: on machines without
//! the driver the answer is simply "unknown".

use std::ffi::c_void;
use std::sync::OnceLock;

#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

struct Nvml {
    _lib: libloading::Library,
    get_handle: unsafe extern "C" fn(u32, *mut *mut c_void) -> i32,
    get_memory: unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> i32,
}

fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| unsafe {
        let lib = libloading::Library::new("libnvidia-ml.so.1").ok()?;
        let init: libloading::Symbol<unsafe extern "C" fn() -> i32> = lib.get(b"nvmlInit_v2").ok()?;
        if init() != 0 {
            return None;
        }
        let get_handle = *lib.get(b"nvmlDeviceGetHandleByIndex_v2").ok()?;
        let get_memory = *lib.get(b"nvmlDeviceGetMemoryInfo").ok()?;
        Some(Nvml {
            _lib: lib,
            get_handle,
            get_memory,
        })
    })
    .as_ref()
}

/// Free and total memory of CUDA device `index`, bytes; `None` without a driver.
pub fn device_memory(index: i32) -> Option<(u64, u64)> {
    let nvml = nvml()?;
    unsafe {
        let mut handle = std::ptr::null_mut();
        if (nvml.get_handle)(index.try_into().ok()?, &mut handle) != 0 {
            return None;
        }
        let mut memory = NvmlMemory::default();
        if (nvml.get_memory)(handle, &mut memory) != 0 {
            return None;
        }
        Some((memory.free, memory.total))
    }
}
