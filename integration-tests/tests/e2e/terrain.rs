//! Terrain maps over HTTP: tasks go through the broker to a group of two workers running the
//! pretrained terrain model, their images land in the S3 server, and a seed repeats its image.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use serde_json::json;
use sluice_integration_tests::{completions_for, png_info, sha256_hex};
use sluice_schemas::CompletionStatus;

use crate::stacks::terrain_cluster;

#[tokio::test(flavor = "multi_thread")]
async fn tasks_over_http_complete_with_their_images_in_s3() {
    let c = terrain_cluster().await;
    let sizes = [(128u32, 128u32, 1u32), (96, 64, 2), (200, 150, 1), (256, 128, 1)];
    let mut requested = HashMap::new();
    for i in 0..24u32 {
        let (w, h, n) = sizes[i as usize % sizes.len()];
        let body = json!({"model": "terrain", "width": w, "height": h, "num_images": n, "seed": i, "params": {"difficulty": 1 + i * 4, "colormap": if i % 3 == 0 { "grey" } else { "terrain" }}});
        let id = c.submit_ok(&body).await.unwrap();
        requested.insert(id, (w, h, n, i % 3 == 0));
    }
    let ids: BTreeSet<String> = requested.keys().cloned().collect();
    let completions = completions_for(c.stack.brokers(), &ids, Duration::from_secs(240));

    let sink = c.stack.sink().unwrap();
    let mut workers = BTreeSet::new();
    for (id, (w, h, n, grey)) in &requested {
        let event = &completions[id];
        assert_eq!(event.status, CompletionStatus::Succeeded, "{event:?}");
        assert_eq!(event.tenant, "acme");
        assert_eq!(event.outputs.len(), *n as usize);
        assert!(
            event.timings.inference_ms > 0 && event.timings.total_ms >= event.timings.inference_ms,
            "{:?}",
            event.timings
        );
        workers.insert(event.worker_id.clone());
        for (index, output) in event.outputs.iter().enumerate() {
            assert_eq!(output.index as usize, index);
            assert!(output.key.ends_with(&format!("{id}/{index}.png")), "{}", output.key);
            assert_eq!(output.url, format!("s3://sluice/{}", output.key));
            let bytes = sink.read(&output.key).await.unwrap();
            assert_eq!(bytes.len() as u64, output.bytes);
            assert_eq!(sha256_hex(&bytes), output.sha256);
            let (pw, ph, color, depth) = png_info(&bytes).unwrap();
            assert_eq!((pw, ph), (*w, *h), "PNG size of {id}");
            assert_eq!((output.width, output.height), (*w, *h));
            if *grey {
                assert_eq!((color, depth), (png::ColorType::Grayscale, png::BitDepth::Sixteen));
            } else {
                assert_eq!((color, depth), (png::ColorType::Rgb, png::BitDepth::Eight));
            }
        }
    }
    assert_eq!(
        workers,
        BTreeSet::from(["worker-0".to_owned(), "worker-1".to_owned()]),
        "both workers of the group took tasks"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_seed_gives_the_same_image() {
    let c = terrain_cluster().await;
    let body = |seed: u64| json!({"model": "terrain", "seed": seed, "width": 160, "height": 160, "params": {"difficulty": 60}});
    let a = c.submit_ok(&body(7)).await.unwrap();
    let b = c.submit_ok(&body(7)).await.unwrap();
    let other = c.submit_ok(&body(8)).await.unwrap();
    let ids = BTreeSet::from([a.clone(), b.clone(), other.clone()]);
    let done = completions_for(c.stack.brokers(), &ids, Duration::from_secs(120));
    assert_eq!(done[&a].outputs[0].sha256, done[&b].outputs[0].sha256, "same seed, same image");
    assert_ne!(
        done[&a].outputs[0].sha256, done[&other].outputs[0].sha256,
        "another seed, another image"
    );
}
