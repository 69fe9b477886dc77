//! Unit tests of `models`.

use super::*;

/// However many distinct requests arrive, a model's label values stay few.
#[test]
fn labels_are_a_size_class_per_model() {
    // Keys as Stable Diffusion names them, with the pixels of their `WxH`.
    let bucket = |key: String, rows: usize| Bucket {
        model: "sd".into(),
        key: {
            let size = key.split(':').next().and_then(|s| s.split_once('x'));
            let pixels = size.map(|(w, h)| w.parse::<u64>().unwrap() * h.parse::<u64>().unwrap());
            CallKey::new(key, pixels)
        },
        rows_per_task: rows,
        alone: None,
    };
    assert_eq!(bucket("512x512:euler:25:cfg".into(), 1).label(), "sd:le262144");
    assert_eq!(bucket("512x512:ddim:30:nocfg".into(), 1).label(), "sd:le262144");
    assert_eq!(bucket(String::new(), 9).label(), "sd:le16");
    let mut labels = std::collections::BTreeSet::new();
    for w in (64..=1024).step_by(8) {
        for h in (64..=1024).step_by(64) {
            for steps in 1..=50 {
                for images in 1..=4 {
                    labels.insert(bucket(format!("{w}x{h}:euler:{steps}:cfg"), images).label());
                }
            }
        }
    }
    assert!(labels.len() <= 16, "{} labels for ~1.5 million buckets", labels.len());
}
