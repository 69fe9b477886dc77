//! Per-model defaults and parameters: how a [`TaskRequest`] becomes a fully explicit
//! [`Generation`]. The schema bounds every value; this module only fills in what was left out.

use crate::{Generation, TaskRequest};

/// The terrain model: a pretrained one-step consistency UNet conditioned on difficulty.
pub mod terrain {
    use serde_json::{Map, Value};

    pub const NAME: &str = "terrain";
    /// The model's fixed spatial size; larger maps are tiled.
    pub const NATIVE_SIZE: u32 = 128;
    pub const DEFAULT_DIFFICULTY: u8 = 50;
    pub const DEFAULT_TILE_OVERLAP: u32 = 32;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Colormap {
        /// RGB colour ramp (water, lowland, highland, rock, snow).
        Terrain,
        /// 16-bit greyscale heightmap, full precision, for simulators.
        Grey,
    }

    impl Colormap {
        pub fn as_str(self) -> &'static str {
            match self {
                Colormap::Terrain => "terrain",
                Colormap::Grey => "grey",
            }
        }
    }

    /// Tile origins along one axis of `length` pixels (at least [`NATIVE_SIZE`]): every
    /// `NATIVE_SIZE - overlap` pixels, plus one flush with the far edge.
    pub fn tile_starts(length: usize, overlap: usize) -> Vec<usize> {
        let n = NATIVE_SIZE as usize;
        if length <= n {
            return vec![0];
        }
        let stride = n - overlap;
        let mut starts: Vec<usize> = (0..=length - n).step_by(stride).collect();
        if *starts.last().expect("at least one") != length - n {
            starts.push(length - n);
        }
        starts
    }

    /// Tiles along one axis: `tile_starts(length, overlap).len()`, without building them.
    fn tile_count(length: u64, overlap: u64) -> u64 {
        let n = NATIVE_SIZE as u64;
        if length <= n { 1 } else { (length - n).div_ceil(n - overlap) + 1 }
    }

    /// Model rows (128×128 tiles) of a task: maps up to the native size are one row each,
    /// larger ones one per tile. This is the work and memory a task asks of the model.
    pub fn rows(width: u32, height: u32, images: u32, overlap: u32) -> u64 {
        let overlap = u64::from(overlap.min(NATIVE_SIZE - 1));
        tile_count(width.into(), overlap) * tile_count(height.into(), overlap) * u64::from(images)
    }

    /// The `params` of a terrain task.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Params {
        pub difficulty: u8,
        pub colormap: Colormap,
        pub tile_overlap: u32,
    }

    impl Default for Params {
        fn default() -> Self {
            Params {
                difficulty: DEFAULT_DIFFICULTY,
                colormap: Colormap::Terrain,
                tile_overlap: DEFAULT_TILE_OVERLAP,
            }
        }
    }

    impl Params {
        /// Reads params that have passed schema validation; absent values take defaults.
        pub fn from_map(map: &Map<String, Value>) -> Result<Params, String> {
            let mut params = Params::default();
            if let Some(v) = map.get("difficulty") {
                params.difficulty = v
                    .as_u64()
                    .filter(|d| (1..=100).contains(d))
                    .ok_or_else(|| format!("params.difficulty must be 1..=100, got {v}"))? as u8;
            }
            if let Some(v) = map.get("colormap") {
                params.colormap = match v.as_str() {
                    Some("terrain") => Colormap::Terrain,
                    Some("grey") => Colormap::Grey,
                    _ => return Err(format!("params.colormap must be terrain or grey, got {v}")),
                };
            }
            if let Some(v) = map.get("tile_overlap") {
                params.tile_overlap =
                    v.as_u64()
                        .filter(|o| *o < NATIVE_SIZE as u64)
                        .ok_or_else(|| format!("params.tile_overlap must be below {NATIVE_SIZE}, got {v}"))? as u32;
            }
            Ok(params)
        }

        pub fn to_map(self) -> Map<String, Value> {
            let mut map = Map::new();
            map.insert("difficulty".into(), self.difficulty.into());
            map.insert("colormap".into(), self.colormap.as_str().into());
            map.insert("tile_overlap".into(), self.tile_overlap.into());
            map
        }
    }
}

/// Fills every value a terrain request left out with the model's default. `seed` is called only
/// when the request has none, so that the record carries the seed it will be generated with.
/// (Requests of every kind go through [`crate::catalog::Catalog::normalize`].)
pub(crate) fn normalize_terrain(request: TaskRequest, seed: impl FnOnce() -> u64) -> Result<(String, Generation), String> {
    let params = terrain::Params::from_map(&request.params.clone().unwrap_or_default())?;
    Ok((
        request.model,
        Generation {
            prompt: request.prompt.unwrap_or_default(),
            negative_prompt: request.negative_prompt,
            steps: request.steps.unwrap_or(1),
            guidance_scale: request.guidance_scale.unwrap_or(1.0),
            seed: request.seed.unwrap_or_else(seed),
            sampler: request.sampler.unwrap_or_else(|| "onestep".to_owned()),
            width: request.width.unwrap_or(terrain::NATIVE_SIZE),
            height: request.height.unwrap_or(terrain::NATIVE_SIZE),
            num_images: request.num_images.unwrap_or(1),
            params: params.to_map(),
            init_image: None,
            mask_image: None,
            strength: None,
        },
    ))
}

/// Largest seed the schema accepts (2^53-1), so that a drawn seed is always valid.
pub const MAX_SEED: u64 = (1 << 53) - 1;

#[cfg(test)]
mod tests {
    use super::terrain::{rows, tile_starts};

    #[test]
    fn rows_count_the_tiles_the_worker_cuts() {
        for overlap in [0u32, 1, 32, 96, 127] {
            for length in [1u32, 64, 128, 129, 200, 255, 256, 320, 512, 1000, 1024, 2048] {
                let tiles = tile_starts(length.max(128) as usize, overlap as usize).len() as u64;
                assert_eq!(rows(length, 16, 1, overlap), tiles, "{length} {overlap}");
                assert_eq!(rows(length, length, 3, overlap), 3 * tiles * tiles, "{length} {overlap}");
            }
        }
        // The request of issue 19: ~29,800 rows.
        assert_eq!(rows(2048, 2048, 8, 96), 29_768);
    }
}
