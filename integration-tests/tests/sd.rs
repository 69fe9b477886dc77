//! Stable Diffusion end to end: prompts submitted over HTTP to a producer and a worker that serve
//! the demo catalog (terrain and the tiny random-weight SD model), through the real broker, to
//! PNGs in the S3 server and completion events.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sluice_integration_tests::cluster::Cluster;
use sluice_integration_tests::stack::repo_root;
use sluice_integration_tests::{completions_for, names_field, png_info, rejected_fields, sha256_hex};
use sluice_schemas::CompletionStatus;
use tokio::sync::OnceCell;

static CLUSTER: OnceCell<Cluster> = OnceCell::const_new();
const WEBHOOK_KEY: &[u8] = b"sluice-sd-test-webhook-secret-32";

async fn cluster() -> &'static Cluster {
    CLUSTER
        .get_or_init(|| async {
            let catalog = repo_root().join("deploy/models.demo.toml").display().to_string();
            let secret = format!("acme:whsec_{}", base64::engine::general_purpose::STANDARD.encode(WEBHOOK_KEY));
            Cluster::start_with(
                "sd",
                1,
                &[("SLUICE_TEST_FAULTS", HELD_SEEDS)],
                &[
                    ("SLUICE_MODEL_CATALOG", catalog.as_str()),
                    ("SLUICE_WEBHOOK_SECRETS", secret.as_str()),
                    ("SLUICE_WEBHOOK_ALLOW_CIDRS", "127.0.0.1/32"),
                ],
            )
            .await
            .expect("cluster starts")
        })
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn prompts_with_every_sampler_become_pngs_in_s3_and_a_seed_repeats_its_bytes() {
    let c = cluster().await;
    let samplers = ["euler", "euler_a", "ddim", "dpmpp_2m", "dpmpp_2m_karras", "lcm"];
    let mut requested = HashMap::new();
    for (i, sampler) in samplers.iter().enumerate() {
        for (w, h, n) in [(64u32, 64u32, 1u32), (96, 64, 2)] {
            let body = json!({"model": "sd-tiny", "prompt": format!("a lighthouse at dusk, style {i}"),
                "negative_prompt": "blurry", "sampler": sampler, "steps": 4, "width": w, "height": h,
                "num_images": n, "seed": 100 + i as u64});
            requested.insert(c.submit_ok(&body).await.unwrap(), (w, h, n));
        }
    }
    // The same record twice (a fixed seed): the same bytes.
    let twin = json!({"model": "sd-tiny", "prompt": "a red bicycle", "seed": 42, "guidance_scale": 5.0});
    let (a, b) = (c.submit_ok(&twin).await.unwrap(), c.submit_ok(&twin).await.unwrap());
    requested.insert(a.clone(), (64, 64, 1));
    requested.insert(b.clone(), (64, 64, 1));
    // Defaults from the catalog: 64x64, 4 steps, euler.
    let minimal = c.submit_ok(&json!({"model": "sd-tiny", "prompt": "a cat"})).await.unwrap();
    requested.insert(minimal.clone(), (64, 64, 1));

    let ids: BTreeSet<String> = requested.keys().cloned().collect();
    let completions = completions_for(c.stack.brokers(), &ids, Duration::from_secs(240));
    let sink = c.stack.sink().unwrap();
    for (id, (w, h, n)) in &requested {
        let event = &completions[id];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{event:?}");
        assert_eq!(event.model, "sd-tiny");
        assert_eq!(event.outputs.len(), *n as usize);
        for output in &event.outputs {
            let bytes = sink.read(&output.key).await.unwrap();
            assert_eq!(sha256_hex(&bytes), output.sha256);
            let (pw, ph, color, depth) = png_info(&bytes).unwrap();
            assert_eq!((pw, ph), (*w, *h), "PNG size of {id}");
            assert_eq!((color, depth), (png::ColorType::Rgb, png::BitDepth::Eight));
        }
        if *n == 2 {
            assert_ne!(event.outputs[0].sha256, event.outputs[1].sha256, "each image its own noise");
        }
    }
    assert_eq!(
        completions[&a].outputs[0].sha256, completions[&b].outputs[0].sha256,
        "same record, same bytes"
    );
    let distinct: BTreeSet<&str> = completions.values().map(|e| e.outputs[0].sha256.as_str()).collect();
    assert_eq!(distinct.len(), completions.len() - 1, "every other task its own image");
}

/// Submits each named request over HTTP and checks its completion: succeeded, on the requested
/// model, with (width, height, images) PNGs in S3. The first image's sha256 of each, by name.
async fn submit_and_check_pngs<'a>(c: &Cluster, requests: Vec<(&'a str, Value, (u32, u32, u32))>) -> HashMap<&'a str, String> {
    let mut requested = HashMap::new();
    for (name, body, size) in requests {
        let model = body["model"].as_str().unwrap().to_owned();
        requested.insert(name, (c.submit_ok(&body).await.unwrap(), model, size));
    }
    let ids: BTreeSet<String> = requested.values().map(|(id, ..)| id.clone()).collect();
    let completions = completions_for(c.stack.brokers(), &ids, Duration::from_secs(240));
    let sink = c.stack.sink().unwrap();
    let mut first = HashMap::new();
    for (name, (id, model, (w, h, n))) in &requested {
        let event = &completions[id];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{name}: {event:?}");
        assert_eq!((&event.model, event.outputs.len()), (model, *n as usize), "{name}");
        for output in &event.outputs {
            let (pw, ph, ..) = png_info(&sink.read(&output.key).await.unwrap()).unwrap();
            assert_eq!((pw, ph), (*w, *h), "PNG size of {name}");
        }
        first.insert(*name, event.outputs[0].sha256.clone());
    }
    first
}

#[tokio::test(flavor = "multi_thread")]
async fn sdxl_prompts_become_pngs_and_an_absent_negative_prompt_is_not_an_empty_one() {
    let c = cluster().await;
    let base = json!({"model": "sdxl-tiny", "prompt": "a lighthouse at dusk", "seed": 7, "steps": 4});
    let with = |extra: Value| {
        let mut body = base.clone();
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let first = submit_and_check_pngs(
        c,
        vec![
            ("absent", base.clone(), (64u32, 64u32, 1u32)),
            ("absent again", base.clone(), (64, 64, 1)),
            ("empty", with(json!({"negative_prompt": ""})), (64, 64, 1)),
            ("negative", with(json!({"negative_prompt": "blurry"})), (64, 64, 1)),
            (
                "two, 96x64, euler_a",
                with(json!({"sampler": "euler_a", "width": 96, "height": 64, "num_images": 2})),
                (96, 64, 2),
            ),
            (
                "turbo-like",
                with(json!({"sampler": "euler_a", "steps": 1, "guidance_scale": 0.0})),
                (64, 64, 1),
            ),
        ],
    )
    .await;
    assert_eq!(first["absent"], first["absent again"], "same record, same bytes");
    assert_ne!(
        first["absent"], first["empty"],
        "an absent negative prompt zeroes the unconditional embeddings; \"\" is encoded"
    );
    assert_ne!(first["empty"], first["negative"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn flux_and_sd3_prompts_become_pngs_and_what_they_do_not_run_is_refused() {
    let c = cluster().await;
    let first = submit_and_check_pngs(
        c,
        vec![
            (
                "schnell",
                json!({"model": "flux-schnell-tiny", "prompt": "a lighthouse at dusk", "seed": 3}),
                (64u32, 64u32, 1u32),
            ),
            (
                "schnell again",
                json!({"model": "flux-schnell-tiny", "prompt": "a lighthouse at dusk", "seed": 3}),
                (64, 64, 1),
            ),
            (
                "schnell, 1 step, 96x64 x2",
                json!({"model": "flux-schnell-tiny", "prompt": "a red bicycle", "steps": 1, "width": 96, "height": 64, "num_images": 2}),
                (96, 64, 2),
            ),
            (
                "dev",
                json!({"model": "flux-dev-tiny", "prompt": "a lighthouse at dusk", "seed": 3}),
                (64, 64, 1),
            ),
            (
                "dev, guidance 7",
                json!({"model": "flux-dev-tiny", "prompt": "a lighthouse at dusk", "seed": 3, "guidance_scale": 7.0}),
                (64, 64, 1),
            ),
            (
                "sd3",
                json!({"model": "sd3-tiny", "prompt": "a lighthouse at dusk", "seed": 3, "negative_prompt": "blurry"}),
                (64, 64, 1),
            ),
            (
                "sd3, no guidance",
                json!({"model": "sd3-tiny", "prompt": "a lighthouse at dusk", "seed": 3, "guidance_scale": 1.0}),
                (64, 64, 1),
            ),
            (
                "sd3, 128x64 x2",
                json!({"model": "sd3-tiny", "prompt": "a harbour", "width": 128, "height": 64, "num_images": 2}),
                (128, 64, 2),
            ),
        ],
    )
    .await;
    assert_eq!(first["schnell"], first["schnell again"], "same record, same bytes");
    assert_ne!(first["schnell"], first["dev"], "another model");
    assert_ne!(first["dev"], first["dev, guidance 7"], "dev's guidance embedding changes the image");
    assert_ne!(first["sd3"], first["sd3, no guidance"]);

    for (body, field) in [
        (
            json!({"model": "flux-schnell-tiny", "prompt": "x", "negative_prompt": "blurry"}),
            "negative_prompt",
        ),
        (json!({"model": "flux-dev-tiny", "prompt": "x", "sampler": "euler"}), "sampler"),
        (json!({"model": "sd3-tiny", "prompt": "x", "width": 72}), "width"),
        (
            json!({"model": "flux-schnell-tiny", "prompt": "x", "guidance_scale": 3.5}),
            "guidance_scale",
        ),
        (
            json!({"model": "sd3-tiny", "prompt": "x", "init_image": image_url(64, 64, false, false)}),
            "init_image",
        ),
    ] {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(names_field(&reply, field), "{body}: {reply}");
    }
}

/// An RGB image of `w` × `h` as a data URL: a gradient, or (`mask`) black with a white square in
/// the middle; PNG, or JPEG where `jpeg`.
fn image_url(w: u32, h: u32, mask: bool, jpeg: bool) -> String {
    let img = image::RgbImage::from_fn(w, h, |x, y| match mask {
        false => image::Rgb([(x * 255 / w) as u8, (y * 255 / h) as u8, 96]),
        true if (w / 4..3 * w / 4).contains(&x) && (h / 4..3 * h / 4).contains(&y) => image::Rgb([255; 3]),
        true => image::Rgb([0; 3]),
    });
    let (format, mime) = match jpeg {
        true => (image::ImageFormat::Jpeg, "image/jpeg"),
        false => (image::ImageFormat::Png, "image/png"),
    };
    let mut bytes = Vec::new();
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut std::io::Cursor::new(&mut bytes), format)
        .unwrap();
    format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// img2img and inpainting over HTTP: input images sent as data URLs (PNG and JPEG) are stored
/// by the producer under their hash, read and checked by the worker, and the tasks become PNGs
/// of their size: img2img on SD and SDXL at two strengths, inpainting with an ordinary UNet
/// (blending) and with a 9-channel inpainting UNet, two images per task. The same image twice
/// is stored once; a strength changes the result.
#[tokio::test(flavor = "multi_thread")]
async fn img2img_and_inpainting_tasks_with_images_sent_inline_become_pngs() {
    let c = cluster().await;
    let init = image_url(96, 64, false, false);
    let mask = image_url(96, 64, true, false);
    let size = json!({"width": 96, "height": 64, "prompt": "a lighthouse at dusk", "seed": 11, "steps": 4});
    let task = |extra: Value| {
        let mut body = size.clone();
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let mut requested = HashMap::new();
    for (name, body, n) in [
        (
            "sd img2img 0.75",
            task(json!({"model": "sd-tiny", "init_image": init, "strength": 0.75})),
            1u32,
        ),
        (
            "sd img2img 0.5",
            task(json!({"model": "sd-tiny", "init_image": init, "strength": 0.5})),
            1,
        ),
        (
            "sd img2img jpeg, euler_a, 2 images",
            task(json!({"model": "sd-tiny", "init_image": image_url(96, 64, false, true), "sampler": "euler_a", "num_images": 2})),
            2,
        ),
        (
            "sdxl img2img",
            task(json!({"model": "sdxl-tiny", "init_image": init, "strength": 0.6})),
            1,
        ),
        (
            "sd inpaint (blend)",
            task(json!({"model": "sd-tiny", "init_image": init, "mask_image": mask})),
            1,
        ),
        (
            "9-channel inpaint, 2 images",
            task(json!({"model": "sd-tiny-inpaint", "init_image": init, "mask_image": mask, "num_images": 2})),
            2,
        ),
        (
            "sdxl inpaint",
            task(json!({"model": "sdxl-tiny", "init_image": init, "mask_image": mask, "strength": 0.75})),
            1,
        ),
    ] {
        requested.insert(name, (c.submit_ok(&body).await.unwrap(), n));
    }
    let ids: BTreeSet<String> = requested.values().map(|(id, _)| id.clone()).collect();
    let completions = completions_for(c.stack.brokers(), &ids, Duration::from_secs(240));
    let sink = c.stack.sink().unwrap();
    let mut first = HashMap::new();
    for (name, (id, n)) in &requested {
        let event = &completions[id];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{name}: {event:?}");
        assert_eq!(event.outputs.len(), *n as usize, "{name}");
        for output in &event.outputs {
            let (pw, ph, ..) = png_info(&sink.read(&output.key).await.unwrap()).unwrap();
            assert_eq!((pw, ph), (96, 64), "PNG size of {name}");
        }
        first.insert(*name, event.outputs[0].sha256.clone());
    }
    assert_ne!(first["sd img2img 0.75"], first["sd img2img 0.5"], "strength changes the result");
    // The records carry references, not pixels: the init image is stored once, under its hash.
    let records =
        sluice_integration_tests::TopicReader::snapshot(c.stack.brokers(), sluice_schemas::topics::TASKS, Duration::from_secs(5)).unwrap();
    let refs: Vec<Value> = records
        .iter()
        .filter_map(|r| serde_json::from_slice::<Value>(&r.value).ok())
        .filter(|v| ids.contains(v["task_id"].as_str().unwrap_or_default()))
        .map(|v| v["request"]["init_image"].clone())
        .collect();
    assert_eq!(refs.len(), ids.len());
    let largest = records.iter().map(|r| r.value.len()).max().unwrap();
    assert!(largest < 4096, "records stay small: {largest} bytes");
    let key = refs[0]["key"].as_str().unwrap();
    assert_eq!(key, format!("{}.png", refs[0]["sha256"].as_str().unwrap()));
    let stored = sink.read(&format!("inputs/{key}")).await.unwrap();
    assert_eq!(sha256_hex(&stored), refs[0]["sha256"].as_str().unwrap());
}

/// Hostile or unusable input images are 400s naming the field, and nothing is published.
#[tokio::test(flavor = "multi_thread")]
async fn bad_input_images_are_refused_naming_the_field() {
    let c = cluster().await;
    // A PNG that claims 30000 x 30000 pixels: refused from its header.
    let bomb = {
        let mut bytes = Vec::new();
        {
            let mut encoder = png::Encoder::new(&mut bytes, 30_000, 30_000);
            encoder.set_color(png::ColorType::Grayscale);
            let mut writer = encoder.write_header().unwrap();
            // A little data: the header is all a decoder needs to refuse it.
            writer.write_chunk(png::chunk::IDAT, &[0u8; 64]).unwrap();
        }
        format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let init = image_url(64, 64, false, false);
    for (body, field, says) in [
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": image_url(96, 64, false, false)}),
            "init_image",
            "the image is 96x64, the task 64x64",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "mask_image": image_url(96, 64, true, false)}),
            "mask_image",
            "96x64",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "data:image/png;base64,not-base64!"}),
            "init_image",
            "not base64",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "data:image/png;base64,aGVsbG8="}),
            "init_image",
            "not a readable png",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "data:image/gif;base64,R0lGODlh"}),
            "init_image",
            "",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": "https://example.com/a.png"}),
            "init_image",
            "",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": bomb}),
            "init_image",
            "not a readable png",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "mask_image": init}),
            "init_image",
            "is required",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "strength": 0}),
            "strength",
            "",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "strength": 0.1, "steps": 4}),
            "strength",
            "runs no step",
        ),
        (json!({"model": "terrain", "init_image": init}), "init_image", ""),
        // The catalog's modes: the 9-channel inpainting model takes an image and a mask.
        (
            json!({"model": "sd-tiny-inpaint", "prompt": "x"}),
            "init_image",
            "takes inpaint tasks, not text",
        ),
        (
            json!({"model": "sd-tiny-inpaint", "prompt": "x", "init_image": init}),
            "mask_image",
            "not img2img",
        ),
        (
            json!({"model": "sd-tiny", "prompt": "x", "init_image": init, "sampler": "lcm"}),
            "sampler",
            "lcm",
        ),
    ] {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{field} {says}: {reply}");
        let named = rejected_fields(&reply)
            .iter()
            .any(|(f, m)| f.starts_with(field) && m.contains(says));
        assert!(named, "{field} {says}: {reply}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_catalog_bounds_requests_and_lists_the_models() {
    let c = cluster().await;
    let models: Value = reqwest::get(format!("{}/v1/models", c.producer_url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let names: Vec<&str> = models["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "terrain",
            "sd-tiny",
            "sdxl-tiny",
            "sd-tiny-inpaint",
            "flux-schnell-tiny",
            "flux-dev-tiny",
            "sd3-tiny"
        ]
    );
    let sd = &models["models"][1];
    assert_eq!(sd["kind"], "diffusion");
    assert_eq!(sd["width"], json!({"min": 64, "max": 256, "default": 64}));
    assert_eq!(sd["default_sampler"], "euler");

    for (body, field) in [
        (json!({"model": "sd-xl", "prompt": "x"}), "model"),
        (json!({"model": "sd-tiny"}), "prompt"),
        (json!({"model": "sd-tiny", "prompt": "x", "width": 1024}), "width"),
        (json!({"model": "sd-tiny", "prompt": "x", "width": 100}), "width"),
        (json!({"model": "sd-tiny", "prompt": "x", "steps": 21}), "steps"),
        (json!({"model": "sd-tiny", "prompt": "x", "sampler": "lcm", "steps": 12}), "steps"),
        (json!({"model": "sd-tiny", "prompt": "x", "sampler": "plms"}), "sampler"),
        (json!({"model": "sd-tiny", "prompt": "x", "num_images": 5}), "num_images"),
    ] {
        let (status, reply) = c.submit(&body).await.unwrap();
        assert_eq!(status, 400, "{body}: {reply}");
        let fields: Vec<&str> = rejected_fields(&reply).into_iter().map(|(f, _)| f).collect();
        assert!(fields.contains(&field), "{body}: {reply}");
        if field == "model" {
            assert!(
                reply
                    .to_string()
                    .contains("terrain, sd-tiny, sdxl-tiny, sd-tiny-inpaint, flux-schnell-tiny"),
                "lists the served models: {reply}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_reports_its_start_and_steps_on_the_progress_topic() {
    let c = cluster().await;
    let id = c
        .submit_ok(&json!({"model": "sd-tiny", "prompt": "a windmill", "steps": 6, "sampler": "ddim", "width": 128, "height": 128}))
        .await
        .unwrap();
    let mut reader = sluice_integration_tests::TopicReader::new(c.stack.brokers(), sluice_schemas::topics::PROGRESS).unwrap();
    let mine = |records: &[sluice_integration_tests::Consumed]| -> Vec<sluice_schemas::ProgressRecord> {
        records
            .iter()
            .filter(|r| r.key.as_deref() == Some(id.as_bytes()))
            .map(|r| {
                let value: Value = serde_json::from_slice(&r.value).unwrap();
                sluice_schemas::validate(sluice_schemas::RecordKind::Progress, &value).unwrap();
                serde_json::from_value(value).unwrap()
            })
            .collect()
    };
    tokio::task::block_in_place(|| reader.read_until(Duration::from_secs(120), |r| mine(r).iter().any(|p| p.step == 6))).unwrap();
    let records = mine(&reader.records);
    assert_eq!(records[0].event, sluice_schemas::ProgressEvent::Started, "{records:?}");
    let steps: Vec<u32> = records[1..].iter().map(|p| p.step).collect();
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "in order: {steps:?}");
    assert_eq!(*steps.last().unwrap(), 6);
    assert!(records.iter().all(|p| p.steps == 6 && p.model == "sd-tiny"));
    // Throttled to one per 500 ms (plus the last): a run this short reports at most a few.
    let span = records.last().unwrap().at - records[0].at;
    assert!(steps.len() as i64 <= 2 + span.num_milliseconds() / 500, "{steps:?} over {span}");
}

/// Reads a Server-Sent Events response to its end: (event, id, data) of each event.
async fn read_events(response: reqwest::Response) -> Vec<(String, String, Value)> {
    let text = response.text().await.unwrap();
    text.split("\n\n")
        .filter_map(|block| {
            let mut event = String::from("message");
            let (mut id, mut data) = (String::new(), String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim());
                }
            }
            (!data.is_empty()).then(|| (event, id, serde_json::from_str(&data).unwrap()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_watches_a_task_live_over_server_sent_events_to_its_result() {
    let c = cluster().await;
    let id = c
        .submit_ok(
            &json!({"model": "sd-tiny", "prompt": "a harbour at night", "steps": 20, "sampler": "dpmpp_2m", "width": 256, "height": 256}),
        )
        .await
        .unwrap();
    let url = format!("{}/v1/tasks/{id}/events", c.producer_url);
    let key = sluice_integration_tests::cluster::API_KEY;
    let response = reqwest::Client::new().get(&url).bearer_auth(key).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = tokio::time::timeout(Duration::from_secs(180), read_events(response))
        .await
        .expect("the stream ends at the result");
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert!(["status", "progress"].contains(&names[0]), "the current state first: {names:?}");
    assert_eq!(*names.last().unwrap(), "completed", "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "completed").count(), 1);
    let last = &events.last().unwrap().2;
    assert_eq!(last["status"], "succeeded", "{last}");
    assert_eq!(last["task_id"], id.as_str());
    assert_eq!(last["outputs"].as_array().unwrap().len(), 1);
    // The same body as GET.
    let get: Value = reqwest::Client::new()
        .get(format!("{}/v1/tasks/{id}", c.producer_url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // The same body as GET, but for the presigned URLs' signing times.
    let without_urls = |v: &Value| {
        let mut v = v.clone();
        for o in v["outputs"].as_array_mut().unwrap() {
            o.as_object_mut().unwrap().remove("url");
        }
        v
    };
    assert_eq!(without_urls(&get), without_urls(last));
    // A 256x256, 20-step image runs for seconds: the stream saw it running, step by step.
    assert!(events.iter().any(|e| e.2["status"] == "running"), "{names:?}");
    // Resuming after the last event: nothing more, the stream ends at once.
    let resumed = reqwest::Client::new()
        .get(&url)
        .bearer_auth(key)
        .header("last-event-id", events.last().unwrap().1.as_str())
        .send()
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_secs(10), read_events(resumed))
            .await
            .unwrap()
            .is_empty()
    );
    // Another tenant cannot watch it.
    let rival = reqwest::Client::new()
        .get(&url)
        .bearer_auth(sluice_integration_tests::cluster::RIVAL_KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(rival.status().as_u16(), 404);
}

/// Tasks of these seeds are held in their model call until they are cancelled
/// (`SLUICE_TEST_FAULTS=hold-run=…`), so that the cancellation test asserts on events, not on
/// how fast the device runs: a held task is certainly running when it is cancelled, and a task
/// queued behind it certainly queued.
const HELD_SEEDS: &str = "hold-run=7770001,hold-run=7770002";

/// Cancels over HTTP: a queued task is never run, a running diffusion task stops between steps;
/// both end with a `cancelled` completion and no image; a finished task is a 409. The first
/// blocker and the queued task are held until cancelled ([`HELD_SEEDS`]), so this holds on a
/// GPU as on the CPU.
#[tokio::test(flavor = "multi_thread")]
async fn cancelled_tasks_stop_queued_or_running_and_store_nothing() {
    let c = cluster().await;
    let key = sluice_integration_tests::cluster::API_KEY;
    let client = reqwest::Client::new();
    let cancel = |id: String| {
        let client = client.clone();
        let url = format!("{}/v1/tasks/{id}/cancel", c.producer_url);
        async move {
            let r = client.post(url).bearer_auth(key).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    // Work ahead of the queued task: three long tasks of different buckets.
    let mut blockers = Vec::new();
    for (sampler, seed) in [("euler", 7_770_001), ("ddim", 1), ("dpmpp_2m", 2)] {
        let body = json!({"model": "sd-tiny", "prompt": "a busy street", "steps": 20, "sampler": sampler, "width": 256, "height": 256, "seed": seed});
        blockers.push(c.submit_ok(&body).await.unwrap());
    }
    let queued = c
        .submit_ok(&json!({"model": "sd-tiny", "prompt": "never drawn", "width": 64, "height": 64, "seed": 7_770_002}))
        .await
        .unwrap();
    let (status, reply) = cancel(queued.clone()).await;
    assert_eq!(status, 202, "{reply}");
    assert_eq!(reply["status"], "cancelling");

    // The first blocker, once it runs (held there until cancelled), is cancelled between steps.
    let running = blockers[0].clone();
    c.wait_for_status(&running, key, "running", Duration::from_secs(60)).await.unwrap();
    let (status, _) = cancel(running.clone()).await;
    assert_eq!(status, 202);

    let ids: BTreeSet<String> = [queued.clone(), running.clone(), blockers[1].clone(), blockers[2].clone()].into();
    let done = completions_for(c.stack.brokers(), &ids, Duration::from_secs(240));
    for id in [&queued, &running] {
        let event = &done[id];
        assert_eq!(event.status, CompletionStatus::Cancelled, "{event:?}");
        assert!(event.outputs.is_empty() && event.error.is_none());
    }
    for id in &blockers[1..] {
        assert_eq!(done[id].status, CompletionStatus::Succeeded);
    }
    // No image for either; the queued one never started.
    let sink = c.stack.sink().unwrap();
    for id in [&queued, &running] {
        assert!(sink.read(&format!("outputs/{id}/0.png")).await.is_err(), "no image stored for {id}");
    }
    let progress =
        sluice_integration_tests::TopicReader::snapshot(c.stack.brokers(), sluice_schemas::topics::PROGRESS, Duration::from_secs(2))
            .unwrap();
    assert!(
        !progress.iter().any(|r| r.key.as_deref() == Some(queued.as_bytes())),
        "the queued task never ran"
    );
    let steps: Vec<u64> = progress
        .iter()
        .filter(|r| r.key.as_deref() == Some(running.as_bytes()))
        .map(|r| r.json()["step"].as_u64().unwrap())
        .collect();
    assert!(
        steps.iter().all(|s| *s < 20),
        "the running task stopped before its last step: {steps:?}"
    );
    // Finished: a 409; the view says cancelled.
    c.wait_for_status(&queued, key, "cancelled", Duration::from_secs(10)).await.unwrap();
    let (status, reply) = cancel(queued.clone()).await;
    assert_eq!(status, 409, "{reply}");
    assert!(reply["message"].as_str().unwrap().contains("cancelled"), "{reply}");
    let (status, _) = cancel(uuid::Uuid::new_v4().to_string()).await;
    assert_eq!(status, 404);
}

/// W3C trace context through Kafka: the request's `traceparent` continues on the task record,
/// its progress records (one span: the run) and its completion (same trace id); a request
/// without one starts a trace.
#[tokio::test(flavor = "multi_thread")]
async fn the_request_trace_continues_through_task_progress_and_completion() {
    let c = cluster().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let incoming = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let response = reqwest::Client::new()
        .post(format!("{}/v1/tasks", c.producer_url))
        .bearer_auth(sluice_integration_tests::cluster::API_KEY)
        .header("traceparent", &incoming)
        .header("tracestate", "vendor=abc")
        .json(&json!({"model": "sd-tiny", "prompt": "a traced lighthouse", "steps": 8, "width": 128, "height": 128}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let id = response.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned();
    let untraced = c.submit_ok(&json!({"model": "sd-tiny", "prompt": "no trace given"})).await.unwrap();
    // A hostile `tracestate` (over W3C's 32 members, ~1.7 KB) is not copied into the record.
    let hostile = (0..200).map(|i| format!("k{i}=value{i}")).collect::<Vec<_>>().join(",");
    let response = reqwest::Client::new()
        .post(format!("{}/v1/tasks", c.producer_url))
        .bearer_auth(sluice_integration_tests::cluster::API_KEY)
        .header("traceparent", &incoming)
        .header("tracestate", &hostile)
        .json(&json!({"model": "sd-tiny", "prompt": "a hostile trace state"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 202);
    let hostile_id = response.json::<Value>().await.unwrap()["task_id"].as_str().unwrap().to_owned();
    completions_for(
        c.stack.brokers(),
        &BTreeSet::from([id.clone(), untraced.clone()]),
        Duration::from_secs(240),
    );

    let header_of =
        |topic: &str, key: &str| sluice_integration_tests::kafka::header_values(c.stack.brokers(), topic, key, "traceparent").unwrap();
    let task = header_of(sluice_schemas::topics::TASKS, &id);
    let state_of = |key: &str| {
        sluice_integration_tests::kafka::header_values(c.stack.brokers(), sluice_schemas::topics::TASKS, key, "tracestate").unwrap()
    };
    assert_eq!(state_of(&id), vec!["vendor=abc".to_owned()]);
    assert_eq!(
        header_of(sluice_schemas::topics::TASKS, &hostile_id).len(),
        1,
        "the trace itself continues"
    );
    assert_eq!(state_of(&hostile_id), Vec::<String>::new(), "over 32 members: discarded");
    let progress = header_of(sluice_schemas::topics::PROGRESS, &id);
    let completion = header_of(sluice_schemas::topics::COMPLETIONS, &id);
    assert_eq!(task.len(), 1, "{task:?}");
    assert!(!progress.is_empty() && completion.len() == 1, "{progress:?} {completion:?}");
    let mut spans = BTreeSet::new();
    for h in task.iter().chain(&progress).chain(&completion) {
        let parts: Vec<&str> = h.split('-').collect();
        assert_eq!(parts[1], trace_id, "one trace: {h}");
        assert_eq!(parts[3], "01");
        spans.insert(parts[2].to_owned());
    }
    assert!(!spans.contains("00f067aa0ba902b7"), "each record is a child span of the request");
    // Two spans: the producer's (the task record) and the worker's run of it (its progress
    // records and its completion), as exported over OTLP (see monitoring.rs).
    assert_eq!(spans.len(), 2, "{spans:?}");
    let worker_span = completion[0].split('-').nth(2).unwrap();
    assert!(
        progress.iter().all(|p| p.split('-').nth(2) == Some(worker_span)),
        "{progress:?} {completion:?}"
    );
    // No traceparent on the request: the producer starts a trace, the completion continues it.
    let (t, done) = (
        header_of(sluice_schemas::topics::TASKS, &untraced),
        header_of(sluice_schemas::topics::COMPLETIONS, &untraced),
    );
    assert_eq!(t[0].split('-').nth(1), done[0].split('-').nth(1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_webhook_gets_started_progress_and_completed_in_order() {
    let c = cluster().await;
    let (receiver, base) = sluice_integration_tests::receiver::Receiver::start().await;
    let body = json!({"model": "sd-tiny", "prompt": "a lighthouse", "steps": 20, "width": 256, "height": 256, "seed": 5,
        "webhook": {"url": format!("{base}/hook/all"), "events": ["started", "progress", "completed"]}});
    let id = c.submit_ok(&body).await.unwrap();
    sluice_integration_tests::wait_for("the completed event", Duration::from_secs(120), async || {
        receiver.all().iter().any(|r| r.event == "completed").then_some(())
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let all = receiver.all();
    let events: Vec<&str> = all.iter().map(|r| r.event.as_str()).collect();
    assert_eq!(events.first(), Some(&"started"), "{events:?}");
    assert_eq!(events.last(), Some(&"completed"), "{events:?}");
    assert_eq!(events.iter().filter(|e| **e == "completed").count(), 1, "{events:?}");
    assert!(all.iter().all(|r| r.signed_with(WEBHOOK_KEY) && r.json()["task_id"] == id.as_str()));
    let progress: Vec<&sluice_integration_tests::receiver::Received> = all.iter().filter(|r| r.event == "progress").collect();
    let steps: Vec<u64> = progress.iter().map(|r| r.json()["progress"]["step"].as_u64().unwrap()).collect();
    assert!(!steps.is_empty(), "the last step at least is a progress event: {events:?}");
    assert!(steps.windows(2).all(|w| w[0] < w[1]), "steps only move forward: {steps:?}");
    for pair in progress.windows(2) {
        assert!(
            pair[1].at - pair[0].at >= Duration::from_millis(450),
            "progress is throttled to one per 500 ms"
        );
    }
    let ids: BTreeSet<&str> = all.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), all.len(), "each event has its own webhook-id");
    assert_eq!(all.last().unwrap().json()["status"], "succeeded");
}

fn files_under(root: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                let name = path.strip_prefix(root).unwrap().display().to_string();
                out.push((name, std::fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// What the chart's initContainer runs: `sluice-worker sync-models` copies a model repository out
/// of the S3 server; the copy generates the very image the original does, and a second run over
/// the same directory copies nothing.
#[tokio::test(flavor = "multi_thread")]
async fn models_synced_from_s3_generate_the_same_image_as_the_originals() {
    let stack = &cluster().await.stack;
    let original = std::path::PathBuf::from(&stack.env["SLUICE_SD_TINY"]).join("sd-tiny");
    let files = files_under(&original);
    let sink = stack.sink().unwrap();
    for (name, bytes) in &files {
        sink.write(&format!("model-repo/sd-tiny/{name}"), bytes.clone().into())
            .await
            .unwrap();
    }
    let synced = stack.dir.join("synced-models");
    let worker = |args: &[&str]| {
        let output = std::process::Command::new(sluice_integration_tests::process::bin("sluice-worker"))
            .args(args)
            .envs(stack.vars())
            .env("SLUICE_LOG_FORMAT", "text")
            .output()
            .unwrap();
        assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    let sync = || -> Value {
        let url = format!(
            "s3://{}/model-repo",
            stack.env["SLUICE_OUTPUT_URL"]
                .trim_start_matches("s3://")
                .split('/')
                .next()
                .unwrap()
        );
        serde_json::from_str(worker(&["sync-models", "--from", &url, "--to", &synced.display().to_string()]).trim()).unwrap()
    };
    let first = sync();
    assert_eq!(
        (first["copied"].as_u64(), first["unchanged"].as_u64()),
        (Some(files.len() as u64), Some(0)),
        "{first}"
    );
    let again = sync();
    assert_eq!(
        (again["copied"].as_u64(), again["unchanged"].as_u64()),
        (Some(0), Some(files.len() as u64)),
        "{again}"
    );
    let copied: Vec<(String, Vec<u8>)> = files_under(&synced.join("sd-tiny"));
    assert_eq!(copied, files, "byte for byte");

    let generate = |model: &std::path::Path, out: &str| {
        let out = stack.dir.join(out);
        let args = [
            "generate",
            "--model-path",
            &model.display().to_string(),
            "--prompt",
            "a harbour at dawn",
            "--seed",
            "11",
            "--out",
            &out.display().to_string(),
        ];
        worker(&args);
        std::fs::read(out).unwrap()
    };
    let from_original = generate(&original, "original.png");
    let from_copy = generate(&synced.join("sd-tiny"), "synced.png");
    assert!(png_info(&from_copy).is_ok());
    assert_eq!(sha256_hex(&from_copy), sha256_hex(&from_original));
}

/// Metric series stay bounded however many distinct requests arrive: 1,000 tasks, each its own
/// bucket (size × steps × sampler × guidance), add a few size classes to the worker's
/// `/metrics`, not a set of series per request (before: ~18 series per bucket). And a size the
/// catalog admits but the model cannot run (72: the tiny UNet halves 9 latents) is a DLQ'd
/// schema violation at admission, not a model error (before: ONNX Runtime's Concat failed).
#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_distinct_requests_keep_the_metric_series_bounded() {
    let c = cluster().await;
    let mut tasks = Vec::new();
    for guidance in [7.5, 0.0] {
        for steps in 1..=8 {
            for w in (64..=128).step_by(16) {
                for h in (64..=128).step_by(16) {
                    for sampler in ["euler", "euler_a", "ddim"] {
                        let (id, mut record) = sluice_integration_tests::sd_task(tasks.len() as u64, 64, steps, 1);
                        let r = &mut record["request"];
                        (r["width"], r["height"], r["sampler"], r["guidance_scale"]) =
                            (json!(w), json!(h), json!(sampler), json!(guidance));
                        tasks.push((id, record));
                    }
                }
            }
        }
    }
    tasks.truncate(1000);
    let (odd_id, mut odd) = sluice_integration_tests::sd_task(5, 64, 2, 1);
    odd["request"]["width"] = json!(72);
    tasks.push((odd_id.clone(), odd));
    let kafka = sluice_integration_tests::kafka::producer(c.stack.brokers()).unwrap();
    sluice_integration_tests::publish_tasks(&kafka, sluice_schemas::topics::TASKS, &tasks)
        .await
        .unwrap();
    let ids: BTreeSet<String> = tasks.iter().map(|(id, _)| id.clone()).collect();
    let mut done = completions_for(c.stack.brokers(), &ids, Duration::from_secs(600));
    let odd = done.remove(&odd_id).unwrap();
    let error = odd.error.expect("the 72-wide task failed");
    assert_eq!(error.reason, sluice_schemas::DlqReason::SchemaViolation, "{error:?}");
    assert!(error.message.contains("multiples of 16"), "{error:?}");
    let failed: Vec<_> = done.values().filter(|d| d.status != CompletionStatus::Succeeded).collect();
    assert!(
        failed.is_empty(),
        "{} failed, e.g. {:?}",
        failed.len(),
        failed.first().map(|d| &d.error)
    );

    let metrics = c.workers[0].metrics().await.unwrap();
    let series: Vec<&str> = metrics.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).collect();
    let labels: BTreeSet<&str> = series
        .iter()
        .filter_map(|l| l.split("bucket=\"").nth(1)?.split('"').next())
        .collect();
    eprintln!(
        "worker /metrics after 1,000 distinct requests: {} series, bucket labels {labels:?}",
        series.len()
    );
    assert!(
        labels.iter().all(|l| l.starts_with("sd-tiny:le") || l.starts_with("terrain:le")),
        "{labels:?}"
    );
    assert!(labels.len() <= 12, "{labels:?}");
    assert!(series.len() < 1000, "{} series", series.len());
}
