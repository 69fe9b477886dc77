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
            negative_prompt: request.negative_prompt.unwrap_or_default(),
            steps: request.steps.unwrap_or(1),
            guidance_scale: request.guidance_scale.unwrap_or(1.0),
            seed: request.seed.unwrap_or_else(seed),
            sampler: request.sampler.unwrap_or_else(|| "onestep".to_owned()),
            width: request.width.unwrap_or(terrain::NATIVE_SIZE),
            height: request.height.unwrap_or(terrain::NATIVE_SIZE),
            num_images: request.num_images.unwrap_or(1),
            params: params.to_map(),
        },
    ))
}

/// Largest seed the schema accepts (2^53-1), so that a drawn seed is always valid.
pub const MAX_SEED: u64 = (1 << 53) - 1;
