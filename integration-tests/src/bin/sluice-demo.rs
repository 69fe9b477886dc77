//! `make demo`: the main job end to end on the local stack. Starts the producer and two workers
//! on the stack in `.stack` (which `make demo` brings up) serving the demo catalog
//! (`deploy/models.demo.toml`: terrain and the tiny random-weight SD, SDXL, SD inpainting, FLUX.1
//! schnell- and dev-like and SD3.5-like models), submits terrain tasks across difficulties, text-to-image prompts, img2img and
//! inpainting tasks (input images as data URLs) over HTTP, waits for each completion on the
//! completion topic, prints a table and writes a contact sheet of the results beside the inputs.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;
use sluice_integration_tests::cluster::{API_KEY, Worker, metric_value};
use sluice_integration_tests::contact::{Rgb, sheet};
use sluice_integration_tests::process::{Service, bin};
use sluice_integration_tests::stack::{Stack, repo_root};
use sluice_integration_tests::{TopicReader, free_port};
use sluice_schemas::{CompletionEvent, CompletionStatus, topics};

const DIFFICULTIES: [u32; 8] = [1, 15, 30, 45, 60, 75, 90, 100];
const SIZE: u32 = 256;
/// Prompts for the tiny SD, SDXL, FLUX.1 and SD3 models (random weights: the images are
/// noise-like patterns, but each prompt, sampler and seed gives its own): model, prompt, sampler.
const PROMPTS: [(&str, &str, &str); 9] = [
    ("sd-tiny", "a lighthouse on a cliff at dusk", "euler"),
    ("sd-tiny", "a red bicycle in the rain", "euler_a"),
    ("sd-tiny", "an astronaut riding a horse on mars", "dpmpp_2m_karras"),
    ("sd-tiny", "a bowl of ramen, studio photo", "lcm"),
    ("sdxl-tiny", "a lighthouse on a cliff at dusk", "euler"),
    ("sdxl-tiny", "a fox in the snow, watercolor", "dpmpp_2m"),
    ("flux-schnell-tiny", "a lighthouse on a cliff at dusk", "flow_euler"),
    ("flux-dev-tiny", "a fox in the snow, watercolor", "flow_euler"),
    ("sd3-tiny", "an astronaut riding a horse on mars", "flow_euler"),
];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = std::env::var("SLUICE_STACK_DIR")
        .map(Into::into)
        .unwrap_or_else(|_| repo_root().join(".stack"));
    let stack = Stack::up(&dir).context("starting the local stack")?;
    let logs = stack.dir.join("demo");
    println!("stack: broker {}, S3 {}", stack.brokers(), stack.env["AWS_ENDPOINT_URL"]);

    let port = free_port();
    let catalog = repo_root().join("deploy/models.demo.toml").display().to_string();
    let mut env = stack.vars();
    env.push(("SLUICE_MODEL_CATALOG".into(), catalog.clone()));
    env.push(("SLUICE_LISTEN".into(), format!("127.0.0.1:{port}")));
    env.push(("SLUICE_METRICS_LISTEN".into(), format!("127.0.0.1:{}", free_port())));
    env.push(("SLUICE_API_KEYS".into(), format!("demo:{API_KEY}")));
    env.push(("SLUICE_STATUS_PATH".into(), logs.join("status/view.redb").display().to_string()));
    let mut producer = Service::spawn("producer", &bin("sluice-producer"), &["serve"], &env, &logs)?;
    let url = format!("http://127.0.0.1:{port}");
    producer.wait_ready(&format!("{url}/healthz"), Duration::from_secs(30)).await?;
    let mut workers = Vec::new();
    for i in 0..2 {
        workers.push(Worker::start(&stack, &format!("demo-worker-{i}"), &[("SLUICE_MODEL_CATALOG", catalog.as_str())]).await?);
    }
    println!(
        "producer {url}, workers {} and {} (logs in {})",
        workers[0].url,
        workers[1].url,
        logs.display()
    );
    // Both workers hold partitions before the tasks go in, so both get some.
    sluice_integration_tests::wait_for("both workers to be assigned partitions", Duration::from_secs(60), async || {
        let mut counts = Vec::new();
        for w in &workers {
            counts.push(w.metric("sluice_worker_assigned_partitions").await.unwrap_or(0.0));
        }
        counts.iter().all(|c| *c > 0.0).then_some(())
    })
    .await?;

    let client = sluice_service::http_client::client();
    let started = Instant::now();
    let mut submitted = Vec::new();
    let mut bodies: Vec<(serde_json::Value, String)> = DIFFICULTIES
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let body = json!({"model": "terrain", "width": SIZE, "height": SIZE, "seed": 1000 + i, "params": {"difficulty": d}});
            (body, format!("terrain d={d}"))
        })
        .collect();
    for (i, (model, prompt, sampler)) in PROMPTS.iter().enumerate() {
        let mut body = json!({"model": model, "prompt": prompt, "sampler": sampler,
            "steps": 8, "width": 128, "height": 128, "seed": 2000 + i});
        if sluice_integration_tests::demo_catalog()
            .get(model)
            .is_some_and(|m| m.negative_prompt)
        {
            // FLUX.1 takes none (the catalog says so; one would be a 400).
            body["negative_prompt"] = "blurry".into();
        }
        bodies.push((body, format!("{model} {sampler}")));
    }
    // img2img and inpainting: the inputs go in as data URLs, and into the contact sheet beside
    // their results.
    let (init, mask) = (input_image(false), input_image(true));
    for (model, extra, label) in [
        ("sd-tiny", json!({"strength": 0.6}), "sd-tiny img2img"),
        ("sdxl-tiny", json!({"strength": 0.6}), "sdxl-tiny img2img"),
        (
            "sd-tiny-inpaint",
            json!({"mask_image": data_url(&mask)?}),
            "sd-tiny-inpaint inpaint",
        ),
    ] {
        let mut body = json!({"model": model, "prompt": "a lighthouse on a cliff at dusk", "steps": 8,
            "width": 128, "height": 128, "seed": 3000, "init_image": data_url(&init)?});
        body.as_object_mut()
            .context("object")?
            .extend(extra.as_object().context("object")?.clone());
        bodies.push((body, label.to_owned()));
    }
    for (body, label) in bodies {
        let reply: serde_json::Value = client
            .post(format!("{url}/v1/tasks"))
            .bearer_auth(API_KEY)
            .json(&body)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        submitted.push((reply["task_id"].as_str().context("task_id")?.to_owned(), label));
    }
    println!(
        "submitted {} terrain tasks ({SIZE}x{SIZE}, {} tiles each), {} text-to-image tasks (SD, SDXL, FLUX.1 schnell and dev, SD3; 128x128, 8 steps) and 3 \
         from an input image (img2img on SD and SDXL, inpainting) over HTTP; waiting for completions…",
        DIFFICULTIES.len(),
        tiles(SIZE),
        PROMPTS.len()
    );

    let ids: BTreeSet<String> = submitted.iter().map(|(id, _)| id.clone()).collect();
    let mut reader = TopicReader::new(stack.brokers(), topics::COMPLETIONS)?;
    let done = |records: &[sluice_integration_tests::Consumed]| -> HashMap<String, CompletionEvent> {
        records
            .iter()
            .filter_map(|r| serde_json::from_slice::<CompletionEvent>(&r.value).ok())
            .filter(|c| ids.contains(&c.task_id.to_string()))
            .map(|c| (c.task_id.to_string(), c))
            .collect()
    };
    tokio::task::block_in_place(|| reader.read_until(Duration::from_secs(600), |r| done(r).len() == ids.len()))?;
    let completions = done(&reader.records);
    let elapsed = started.elapsed();

    println!();
    println!("{:<38} {:<24} {:<64} {:>8} {:>14}", "task", "model", "object key", "ms", "worker");
    let sink = stack.sink()?;
    let mut images = Vec::new();
    for (id, label) in &submitted {
        let c = &completions[id];
        anyhow::ensure!(c.status == CompletionStatus::Succeeded, "task {id} failed: {:?}", c.error);
        let output = &c.outputs[0];
        println!(
            "{:<38} {:<24} {:<64} {:>8} {:>14}",
            id, label, output.key, c.timings.total_ms, c.worker_id
        );
        // The sheet's font has digits, `d` and `=`: terrain cells are labelled by difficulty.
        let cell = label.strip_prefix("terrain ").unwrap_or_default().to_owned();
        images.push((cell, Rgb::decode(&sink.read(&output.key).await?)?));
    }
    // The image tasks get rows of their own, each result beside its inputs: the init image, then
    // img2img on SD and SDXL; the init image and the mask, then the inpainted result.
    let mut image_tasks = images.split_off(images.len() - 3).into_iter();
    let blank = || (String::new(), Rgb::new(128, 128, [24, 24, 28]));
    while images.len() % 4 != 0 {
        images.push(blank());
    }
    let copy = |i: &Rgb| (String::new(), i.clone());
    images.push(copy(&init));
    images.extend(image_tasks.by_ref().take(2));
    images.push(blank());
    images.push(copy(&init));
    images.push(copy(&mask));
    images.extend(image_tasks);
    let sheet_path = stack.dir.join("demo").join("contact-sheet.png");
    std::fs::write(&sheet_path, sheet(&images, 4).encode()?)?;
    let batches: f64 = {
        let mut n = 0.0;
        for w in &workers {
            n += w
                .metrics()
                .await
                .ok()
                .and_then(|m| {
                    metric_value(
                        &m,
                        &format!(
                            "sluice_worker_batches_total{{bucket=\"terrain:le{}\"}}",
                            tiles(SIZE).next_power_of_two()
                        ),
                    )
                })
                .unwrap_or(0.0);
        }
        n
    };
    println!();
    println!(
        "{} tasks done in {:.1} s in {batches} model calls across 2 workers",
        submitted.len(),
        elapsed.as_secs_f64()
    );
    println!("contact sheet: {}", sheet_path.display());

    for mut w in workers {
        w.service.terminate(Duration::from_secs(30))?;
    }
    producer.terminate(Duration::from_secs(10))?;
    println!(
        "the stack keeps running (settings in {}/env); `make stack-down` stops it",
        stack.dir.display()
    );
    Ok(())
}

/// The demo's input image (a gradient with a disc and a bar) or its mask (white where the disc is:
/// repaint it), 128 × 128.
fn input_image(mask: bool) -> Rgb {
    let mut image = Rgb::new(128, 128, [0, 0, 0]);
    for y in 0..128 {
        for x in 0..128 {
            let disc = (x as i32 - 80).pow(2) + (y as i32 - 56).pow(2) < 28 * 28;
            let bar = (16..112).contains(&x) && (92..104).contains(&y);
            let pixel = match (mask, disc, bar) {
                (true, true, _) => [255; 3],
                (true, false, _) => [0; 3],
                (false, true, _) => [230, 200, 60],
                (false, _, true) => [40, 40, 48],
                (false, false, false) => [(60 + y) as u8, (90 + y / 2) as u8, (200 - y / 2) as u8],
            };
            image.put(x, y, pixel);
        }
    }
    image
}

/// An image as a PNG data URL.
fn data_url(image: &Rgb) -> anyhow::Result<String> {
    use base64::Engine as _;
    Ok(format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(image.encode()?)
    ))
}

fn tiles(size: u32) -> usize {
    sluice_worker::models::terrain::Layout::of(size as usize, size as usize, 1, 32).rows()
}
