//! Hostile records and requests, fuzzed: mutations of the corpus in `integration-tests/fuzz/`
//! (task records as the worker reads them; request bodies as the producer's `POST /v1/tasks`
//! takes them) through the same code the services run on them:
//!
//! - records: `decode_task` (the worker's decode stage) and, for those it accepts, the catalog's
//!   bounds of one task's work (its admission) and an encode/decode round trip;
//! - requests: JSON parsing, then `TaskPublisher::record_with_key` (validation against the demo
//!   catalog, normalization, the record the producer would publish), and the worker's decoding
//!   of that record: every request the producer accepts must be a record the worker accepts.
//!
//! Nothing may panic, and no input may make the code allocate more than a bound proportional to
//! its size (a counting allocator measures each execution's peak). Mutations: bit flips, byte
//! insertions and deletions, range duplication, splices of two corpus entries, and JSON-aware
//! ones (numbers replaced by extremes, strings blown up, deep nesting). Deterministic: the seed
//! is printed and `SLUICE_FUZZ_SEED` replays it.
//!
//! `make test` runs `SLUICE_FUZZ_EXECS` (default 100,000) executions per target; `make fuzz`
//! runs 5,000,000. A finding is printed with its input (hex) and saved to `target/fuzz-findings`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Counts live bytes and their peak since the last reset.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most one execution may allocate beyond what was live before it.
fn allocation_bound(input: &[u8]) -> usize {
    (1 << 20) + 64 * input.len()
}

/// xorshift64*: small, seedable, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const EXTREMES: &[&str] = &[
    "0",
    "-1",
    "1e308",
    "-1e308",
    "18446744073709551616",
    "9223372036854775807",
    "4294967296",
    "0.5",
    "NaN",
    "null",
    "true",
    "\"\"",
    "[]",
    "{}",
];

/// One mutation of `input` (sometimes spliced with `other`).
fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(10) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => v.insert(at, rng.next() as u8),
            2 if !v.is_empty() => {
                let end = (at + 1 + rng.below(16)).min(v.len());
                v.drain(at.min(end)..end);
            }
            3 if !v.is_empty() => {
                let start = rng.below(v.len());
                let end = (start + 1 + rng.below(64)).min(v.len());
                let piece = v[start..end].to_vec();
                v.splice(at..at, piece);
            }
            4 if !other.is_empty() => {
                let start = rng.below(other.len());
                let end = (start + rng.below(other.len() - start + 1)).min(other.len());
                v.truncate(at);
                v.extend_from_slice(&other[start..end]);
            }
            5 => {
                // A number (the run of digits around a position) becomes an extreme.
                if let Some(start) = v.iter().skip(at).position(u8::is_ascii_digit).map(|p| p + at) {
                    let end = v[start..]
                        .iter()
                        .position(|b| !b.is_ascii_digit() && *b != b'.')
                        .map_or(v.len(), |p| p + start);
                    let e = EXTREMES[rng.below(EXTREMES.len())].as_bytes().to_vec();
                    v.splice(start..end, e);
                }
            }
            6 => {
                // A string blown up.
                if let Some(q) = v.iter().skip(at).position(|b| *b == b'"').map(|p| p + at) {
                    let filler = vec![b"a\\u00e9\xe2\x80\xae"[rng.below(9)]; 1 + rng.below(5000)];
                    v.splice(q + 1..q + 1, filler);
                }
            }
            7 => {
                let depth = 1 + rng.below(300);
                let nest: Vec<u8> = std::iter::repeat_n(b'[', depth).chain(std::iter::repeat_n(b']', depth)).collect();
                v.splice(at..at, nest);
            }
            8 => v.truncate(at),
            _ => {
                let e = EXTREMES[rng.below(EXTREMES.len())].as_bytes().to_vec();
                v.splice(at..at, e);
            }
        }
    }
    v
}

fn corpus(dir: &str) -> Vec<Vec<u8>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz").join(dir);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

fn catalog() -> sluice_schemas::Catalog {
    let path = sluice_integration_tests::stack::repo_root().join("deploy/models.demo.toml");
    sluice_schemas::Catalog::load(Some(&path)).expect("the demo catalog loads")
}

/// The worker's side: decoding and admission of one record. Whether it decoded.
fn run_record(catalog: &sluice_schemas::Catalog, input: &[u8]) -> bool {
    let header = Some(b"1".as_slice());
    let Ok(task) = sluice_schemas::decode_task(input, header) else {
        return false;
    };
    {
        if let Some(entry) = catalog.get(&task.model) {
            let _ = entry.check_work(&task.request);
        }
        let again = serde_json::to_vec(&task).expect("a decoded task encodes");
        let back = sluice_schemas::decode_task(&again, header).expect("an encoded task decodes again");
        assert_eq!(back.task_id, task.task_id);
    }
    true
}

/// The producer's side: a request body to the record it would publish, which the worker must
/// accept. Whether the producer accepted it.
fn run_request(catalog: &sluice_schemas::Catalog, input: &[u8]) -> bool {
    let Ok(request) = serde_json::from_slice::<serde_json::Value>(input) else {
        return false;
    };
    let submitter = sluice_producer::publish::Submitter {
        tenant: "acme".into(),
        user: None,
    };
    if let Ok(record) = sluice_producer::publish::TaskPublisher::record_with_key(catalog, &request, &submitter, Some("k")) {
        let bytes = serde_json::to_vec(&record).expect("a record encodes");
        let task = sluice_schemas::decode_task(&bytes, Some(b"1"))
            .unwrap_or_else(|e| panic!("the producer accepted a request whose record the worker refuses: {e:?}"));
        let entry = catalog.get(&task.model).expect("an accepted model is in the catalog");
        let violations = entry.check_work(&task.request);
        assert!(violations.is_empty(), "accepted, yet over its bounds at the worker: {violations:?}");
        return true;
    }
    false
}

/// Runs `target` on `execs` inputs: the corpus, then mutations of it and of the mutants the
/// target accepted (kept, up to 2,000, so mutations go deeper than one step from the corpus).
/// Panics with the input on a finding.
fn fuzz(name: &str, corpus: &[Vec<u8>], execs: usize, seed: u64, target: impl Fn(&[u8]) -> bool + std::panic::RefUnwindSafe) {
    let mut rng = Rng(seed | 1);
    let mut largest_peak = 0;
    let mut seeds = corpus.to_vec();
    let mut accepted = 0usize;
    let started = Instant::now();
    for i in 0..execs {
        let input = if i < seeds.len() {
            seeds[i].clone()
        } else {
            let a = &seeds[rng.below(seeds.len())];
            let b = &seeds[rng.below(seeds.len())];
            mutate(&mut rng, a, b)
        };
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let outcome = std::panic::catch_unwind(|| target(&input));
        let peak = PEAK.load(Ordering::Relaxed).saturating_sub(before);
        largest_peak = largest_peak.max(peak);
        let finding = match outcome {
            Err(_) => Some("panicked".to_owned()),
            Ok(_) if peak > allocation_bound(&input) => Some(format!("allocated {peak} bytes for a {}-byte input", input.len())),
            Ok(took) => {
                if took {
                    accepted += 1;
                    if seeds.len() < 2_000 && i >= corpus.len() {
                        seeds.push(input.clone());
                    }
                }
                None
            }
        };
        if let Some(what) = finding {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-findings");
            let file = dir.join(format!("{name}-{seed}-{i}.bin"));
            if !name.starts_with("self-check") {
                let _ = std::fs::create_dir_all(&dir);
                let _ = std::fs::write(&file, &input);
            }
            let report = format!(
                "fuzz {name}: execution {i} (seed {seed}) {what}; input saved to {}: {}",
                file.display(),
                hex::encode(&input)
            );
            // The panic hook is quiet while fuzzing: say it here too, or the failure is mute.
            if !name.starts_with("self-check") {
                eprintln!("{report}");
            }
            panic!("{report}");
        }
    }
    println!(
        "fuzz {name}: {execs} executions in {:.1} s ({accepted} accepted), seed {seed}, no panic, largest allocation peak {} KiB",
        started.elapsed().as_secs_f64(),
        largest_peak / 1024
    );
}

#[test]
fn hostile_records_and_requests_neither_panic_nor_allocate_without_bound() {
    let execs: usize = std::env::var("SLUICE_FUZZ_EXECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let seed: u64 = std::env::var("SLUICE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("fuzz seed {seed} (SLUICE_FUZZ_SEED replays it)");
    let catalog = catalog();
    let records = corpus("records");
    let requests = corpus("requests");
    // Panics are findings here, reported with their input: keep the default hook quiet while
    // fuzzing, and loud for this test's own assertions.
    std::panic::set_hook(Box::new(|_| {}));
    // The harness finds what it looks for: a panic, and an allocation past the bound.
    let caught = |target: fn(&[u8]) -> bool| std::panic::catch_unwind(|| fuzz("self-check", &records, 1_000, seed, target)).is_err();
    let planted_panic = caught(|input| input.contains(&b'{') && panic!("planted"));
    let planted_allocation = caught(|input| std::hint::black_box(vec![0u8; (4 << 20) | input.len()]).len() > 1);
    let _ = std::panic::take_hook();
    assert!(planted_panic, "a planted panic is found");
    assert!(planted_allocation, "a planted allocation is found");
    std::panic::set_hook(Box::new(|_| {}));
    let accepted = records
        .iter()
        .filter(|r| sluice_schemas::decode_task(r, Some(b"1")).is_ok())
        .count();
    assert!(accepted >= 3, "the record corpus holds valid records to mutate ({accepted})");
    fuzz("records", &records, execs, seed, |input| run_record(&catalog, input));
    fuzz("requests", &requests, execs, seed.wrapping_add(1), |input| {
        run_request(&catalog, input)
    });
    let _ = std::panic::take_hook();
}
