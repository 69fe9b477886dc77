use sluice_worker::engine::*;
use std::sync::Arc;
use std::time::Instant;

#[tokio::main]
async fn main() {
    let cap: Option<usize> = std::env::var("CAP").ok().map(|s| s.parse().unwrap());
    let rt = Arc::new(
        Runtime::init(&RuntimeOptions {
            dylib_path: None,
            cpu_arena_max_bytes: cap,
        })
        .unwrap(),
    );
    let engine = Engine::start(rt.clone(), 1);
    let path = std::env::var("MODEL").unwrap();
    let loader: Loader = Arc::new(move |rt: &Runtime| {
        Ok(Box::new(OrtBackend::load(rt, std::path::Path::new(&path), &SessionOptions::default())?) as Box<dyn Backend>)
    });
    let t = Instant::now();
    println!("load {:?} {:?}", engine.load("m", loader).await, t.elapsed());
    println!("stats after load {:?}", rt.cpu_arena_stats());
    for b in std::env::var("BATCHES")
        .unwrap_or("1,2,4,8".into())
        .split(',')
        .map(|s| s.parse::<usize>().unwrap())
    {
        for rep in 0..2 {
            let inputs = vec![
                Tensor::f32(
                    "noisy",
                    vec![b, 1, 128, 128],
                    (0..b * 128 * 128).map(|i| ((i % 97) as f32 - 48.0) * 1.6).collect(),
                ),
                Tensor::f32("sigma", vec![b], vec![80.0; b]),
                Tensor::f32("difficulty", vec![b], vec![0.5; b]),
            ];
            let t = Instant::now();
            let r = engine.run("m", inputs, false).await;
            if r.as_ref().is_err_and(|e| e.is_oom()) && std::env::var_os("SHRINK").is_some() {
                engine.release_memory("m");
            }
            println!(
                "batch {b} rep {rep}: {:?} ok={} {:?} stats {:?}",
                t.elapsed(),
                r.is_ok(),
                r.as_ref().err().map(|e| e.to_string().chars().take(200).collect::<String>()),
                rt.cpu_arena_stats()
            );
        }
    }
    let rss = || {
        std::fs::read_to_string("/proc/self/statm")
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 4096
            / (1 << 20)
    };
    println!("rss before unload {} MiB", rss());
    engine.unload("m").await;
    println!("rss after unload {} MiB stats {:?}", rss(), rt.cpu_arena_stats());
    println!("reset {:?}", rt.reset_cpu_arena());
    unsafe {
        libc::malloc_trim(0);
    }
    println!("rss after reset+trim {} MiB stats {:?}", rss(), rt.cpu_arena_stats());
}
