//! Diffusion over HTTP: prompts to the tiny SD, SDXL, FLUX.1 and SD3 models with every
//! sampler, img2img and inpainting with images sent inline, become PNGs in the S3 server; what
//! a pipeline does not run is refused.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use sluice_integration_tests::cluster::Cluster;
use sluice_integration_tests::{completions_for, names_field, png_info, sha256_hex};
use sluice_schemas::CompletionStatus;

use crate::stacks::diffusion_cluster;

#[tokio::test(flavor = "multi_thread")]
async fn prompts_with_every_sampler_become_pngs_in_s3_and_a_seed_repeats_its_bytes() {
    let c = diffusion_cluster().await;
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
    let c = diffusion_cluster().await;
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
    let c = diffusion_cluster().await;
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
pub(crate) fn image_url(w: u32, h: u32, mask: bool, jpeg: bool) -> String {
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
    let c = diffusion_cluster().await;
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
