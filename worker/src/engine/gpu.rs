//! The device as NVML (`libnvidia-ml.so.1`, shipped with the driver) reports it: free memory —
//! what the whole device has free, CUDA contexts and other processes included, the figure that
//! decides whether a reload can load again and whether reloads leak — its busy share and its
//! name. Loaded at run time: on machines without the driver the answer is simply "unknown".

use std::ffi::c_void;
use std::sync::OnceLock;

#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// NVML's `nvmlProcessInfo_t` (the layout `nvmlDeviceGetComputeRunningProcesses_v3` fills).
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct NvmlProcessInfo {
    pid: u32,
    used_gpu_memory: u64,
    gpu_instance_id: u32,
    compute_instance_id: u32,
}

#[repr(C)]
#[derive(Default)]
struct NvmlUtilization {
    gpu: u32,
    memory: u32,
}

struct Nvml {
    _lib: libloading::Library,
    get_handle: unsafe extern "C" fn(u32, *mut *mut c_void) -> i32,
    get_memory: unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> i32,
    get_utilization: unsafe extern "C" fn(*mut c_void, *mut NvmlUtilization) -> i32,
    get_name: unsafe extern "C" fn(*mut c_void, *mut std::ffi::c_char, u32) -> i32,
    get_processes: unsafe extern "C" fn(*mut c_void, *mut u32, *mut NvmlProcessInfo) -> i32,
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
        let get_utilization = *lib.get(b"nvmlDeviceGetUtilizationRates").ok()?;
        let get_name = *lib.get(b"nvmlDeviceGetName").ok()?;
        let get_processes = *lib.get(b"nvmlDeviceGetComputeRunningProcesses_v3").ok()?;
        Some(Nvml {
            _lib: lib,
            get_handle,
            get_memory,
            get_utilization,
            get_name,
            get_processes,
        })
    })
    .as_ref()
}

fn handle(nvml: &Nvml, index: i32) -> Option<*mut c_void> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: NVML writes the handle of an existing device or fails.
    (unsafe { (nvml.get_handle)(index.try_into().ok()?, &mut handle) } == 0).then_some(handle)
}

/// The share of the last sample period (1/6 s to 1 s, by device) in which a kernel ran on CUDA
/// device `index`, percent; `None` without a driver.
pub fn utilization(index: i32) -> Option<u32> {
    let nvml = nvml()?;
    let handle = handle(nvml, index)?;
    let mut rates = NvmlUtilization::default();
    // SAFETY: a valid handle and a struct of NVML's layout.
    (unsafe { (nvml.get_utilization)(handle, &mut rates) } == 0).then_some(rates.gpu)
}

/// The name of CUDA device `index` ("NVIDIA H200"); `None` without a driver.
pub fn device_name(index: i32) -> Option<String> {
    let nvml = nvml()?;
    let handle = handle(nvml, index)?;
    let mut name = [0 as std::ffi::c_char; 96];
    // SAFETY: a valid handle and a buffer of the length given.
    if unsafe { (nvml.get_name)(handle, name.as_mut_ptr(), name.len() as u32) } != 0 {
        return None;
    }
    // SAFETY: NVML writes a NUL-terminated string into the buffer.
    Some(unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned())
}

/// Device memory process `pid` holds on CUDA device `index` (its CUDA context included), bytes;
/// `None` without a driver, or where NVML does not list the process under that pid (a container
/// with its own pid namespace sees the host's pids in NVML's list).
pub fn process_memory(index: i32, pid: u32) -> Option<u64> {
    const NVML_ERROR_INSUFFICIENT_SIZE: i32 = 7;
    let nvml = nvml()?;
    let handle = handle(nvml, index)?;
    let mut capacity = 64u32;
    loop {
        let mut count = capacity;
        let mut infos = vec![NvmlProcessInfo::default(); capacity as usize];
        // SAFETY: a valid handle and a buffer of `count` entries of NVML's layout.
        match unsafe { (nvml.get_processes)(handle, &mut count, infos.as_mut_ptr()) } {
            0 => {
                return infos[..count.min(capacity) as usize]
                    .iter()
                    .find(|p| p.pid == pid)
                    .map(|p| p.used_gpu_memory);
            }
            NVML_ERROR_INSUFFICIENT_SIZE if capacity < 65_536 => capacity = count.max(capacity) * 2,
            _ => return None,
        }
    }
}

/// Free and total memory of CUDA device `index`, bytes; `None` without a driver.
pub fn device_memory(index: i32) -> Option<(u64, u64)> {
    let nvml = nvml()?;
    let handle = handle(nvml, index)?;
    unsafe {
        let mut memory = NvmlMemory::default();
        if (nvml.get_memory)(handle, &mut memory) != 0 {
            return None;
        }
        Some((memory.free, memory.total))
    }
}
