//! The terrain model: a pretrained one-step consistency UNet (`adaptive-terrain-diffusion`,
//! MIT) that denoises 128×128 heightfields conditioned on a difficulty class.
//!
//! Sampling follows the model package's own generator: noise scaled to sigma_max is denoised in
//! one call. Maps up to 128 px are sampled at 128×128 and resized; larger maps are cut from one
//! shared noisy canvas into overlapping 128×128 tiles, denoised as one batch, and blended back
//! with a Hann window. So a larger request is a larger batch of tiles — and more memory.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use sluice_schemas::TaskRecord;
use sluice_schemas::normalize::terrain::{Colormap, NATIVE_SIZE, Params, tile_starts};

use super::noise::Gaussian;
use super::{Bucket, ModelAdapter, ModelError, Prepared, Render};
use crate::engine::{Backend, CallKey, EngineError, OrtBackend, Runtime, SessionOptions, Tensor};
use crate::models::encode::{self, Image};

pub const NAME: &str = sluice_schemas::normalize::terrain::NAME;

const N: usize = NATIVE_SIZE as usize;
const SIGMA_MAX: f32 = 80.0;
const NUM_CLASSES: f32 = 100.0;
/// Height range of the training data, metres.
pub const HEIGHT_RANGE: f32 = 22.168_64;
const ASINH_SCALE: f32 = 0.1;

/// The terrain adapter, on ONNX Runtime.
pub struct Terrain {
    runtime: Arc<Runtime>,
}

impl Terrain {
    pub fn new(runtime: Arc<Runtime>) -> Terrain {
        Terrain { runtime }
    }
}

/// How a task's rows map back to images.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub width: usize,
    pub height: usize,
    pub images: usize,
    /// Tile origins (y, x) on the canvas, row-major; empty when the map is sampled at 128×128
    /// and resized.
    pub tiles: Vec<(usize, usize)>,
    pub canvas: (usize, usize),
}

impl Layout {
    pub fn of(width: usize, height: usize, images: usize, overlap: usize) -> Layout {
        if width.max(height) <= N {
            return Layout {
                width,
                height,
                images,
                tiles: Vec::new(),
                canvas: (N, N),
            };
        }
        let canvas = (height.max(N), width.max(N));
        let ys = tile_starts(canvas.0, overlap);
        let xs = tile_starts(canvas.1, overlap);
        let tiles = ys.iter().flat_map(|&y| xs.iter().map(move |&x| (y, x))).collect();
        Layout {
            width,
            height,
            images,
            tiles,
            canvas,
        }
    }

    pub fn rows_per_image(&self) -> usize {
        self.tiles.len().max(1)
    }

    pub fn rows(&self) -> usize {
        self.images * self.rows_per_image()
    }
}

fn layout_of(task: &TaskRecord) -> Result<(Layout, Params), String> {
    let params = Params::from_map(&task.request.params)?;
    let r = &task.request;
    Ok((
        Layout::of(
            r.width as usize,
            r.height as usize,
            r.num_images as usize,
            params.tile_overlap as usize,
        ),
        params,
    ))
}

impl ModelAdapter for Terrain {
    fn bucket(&self, task: &TaskRecord) -> Result<Bucket, ModelError> {
        let (layout, _) = layout_of(task).map_err(ModelError::InvalidInput)?;
        Ok(Bucket {
            key: CallKey::none(),
            model: NAME.to_owned(),
            rows_per_task: layout.rows(),
            alone: None,
        })
    }

    fn prepare(&self, task: &TaskRecord, _inputs: &super::InputImages) -> Result<Prepared, ModelError> {
        let (layout, params) = layout_of(task).map_err(ModelError::InvalidInput)?;
        let rows = layout.rows();
        let mut noisy = vec![0f32; rows * N * N];
        let mut gaussian = Gaussian::new(task.request.seed);
        if layout.tiles.is_empty() {
            gaussian.fill(&mut noisy, SIGMA_MAX);
        } else {
            let (ch, cw) = layout.canvas;
            let mut canvas = vec![0f32; ch * cw];
            let per_image = layout.rows_per_image();
            for image in 0..layout.images {
                gaussian.fill(&mut canvas, SIGMA_MAX);
                for (t, &(y, x)) in layout.tiles.iter().enumerate() {
                    let row = &mut noisy[(image * per_image + t) * N * N..][..N * N];
                    for dy in 0..N {
                        row[dy * N..(dy + 1) * N].copy_from_slice(&canvas[(y + dy) * cw + x..][..N]);
                    }
                }
            }
        }
        let label = (params.difficulty as f32 - 1.0) / (NUM_CLASSES - 1.0);
        Ok(Prepared {
            inputs: vec![
                Tensor::f32("noisy", vec![rows, 1, N, N], noisy),
                Tensor::f32("sigma", vec![rows], vec![SIGMA_MAX; rows]),
                Tensor::f32("difficulty", vec![rows], vec![label; rows]),
            ],
            rows,
            render: Box::new(TerrainRender { layout, params }),
        })
    }

    fn load(&self, path: &Path, options: &SessionOptions) -> Result<Box<dyn Backend>, EngineError> {
        Ok(Box::new(OrtBackend::load(&self.runtime, path, options)?))
    }
}

/// How a task's rows become its maps.
struct TerrainRender {
    layout: Layout,
    params: Params,
}

impl Render for TerrainRender {
    fn render(&self, outputs: &[Tensor], rows: Range<usize>) -> Result<Vec<Image>, ModelError> {
        self.maps(outputs, rows).map_err(ModelError::Failed)
    }
}

impl TerrainRender {
    /// The task's images from its rows of the batch's `denoised` output.
    fn maps(&self, outputs: &[Tensor], rows: Range<usize>) -> Result<Vec<Image>, String> {
        let TerrainRender { layout, params } = self;
        let denoised = outputs
            .iter()
            .find(|t| t.name == "denoised")
            .or(outputs.first())
            .and_then(|t| t.f32_rows(rows.start, rows.end))
            .ok_or("model output `denoised` missing or not float32")?;
        if denoised.len() != layout.rows() * N * N {
            return Err(format!(
                "model output has {} values, expected {}",
                denoised.len(),
                layout.rows() * N * N
            ));
        }
        let per_image = layout.rows_per_image();
        (0..layout.images)
            .map(|image| {
                let rows = &denoised[image * per_image * N * N..][..per_image * N * N];
                let heights = if layout.tiles.is_empty() {
                    let native: Vec<f32> = rows.iter().map(|&v| to_height(v)).collect();
                    let mut h = resize_bilinear(&native, (N, N), (layout.height, layout.width));
                    zero_floor(&mut h);
                    h
                } else {
                    blend_tiles(rows, layout)
                };
                render(&heights, layout.width, layout.height, params.colormap)
            })
            .collect()
    }
}

/// Exact model space [-1, 1] to metres: the inverse of the package's asinh compression.
fn to_height_exact(v: f32) -> f32 {
    let unit = ((v + 1.0) * 0.5).clamp(0.0, 1.0);
    let normalizer = (HEIGHT_RANGE / ASINH_SCALE).asinh();
    (ASINH_SCALE * (unit * normalizer).sinh()).clamp(0.0, HEIGHT_RANGE)
}

/// Points of the height table: linear interpolation between them is within 1e-5 m of
/// [`to_height_exact`] (the curve's second derivative is at most ~820 m), far below one level of
/// the 16-bit output (0.34 mm).
const HEIGHT_LUT: usize = 4096;

/// Model space to metres through a table (two `exp` per pixel cost more than everything else in
/// rendering).
fn to_height(v: f32) -> f32 {
    static LUT: std::sync::LazyLock<Vec<f32>> = std::sync::LazyLock::new(|| {
        (0..=HEIGHT_LUT)
            .map(|i| to_height_exact(i as f32 / HEIGHT_LUT as f32 * 2.0 - 1.0))
            .collect()
    });
    let x = ((v + 1.0) * 0.5).clamp(0.0, 1.0) * HEIGHT_LUT as f32;
    let i = (x as usize).min(HEIGHT_LUT - 1);
    let f = x - i as f32;
    LUT[i] + (LUT[i + 1] - LUT[i]) * f
}

fn zero_floor(h: &mut [f32]) {
    let min = h.iter().copied().fold(f32::INFINITY, f32::min);
    if min.is_finite() {
        h.iter_mut().for_each(|v| *v -= min);
    }
}

/// `np.hanning(N)`, floored at 1e-3 so that corners keep a little weight.
fn hann() -> Vec<f32> {
    (0..N)
        .map(|n| (0.5 - 0.5 * (std::f32::consts::TAU * n as f32 / (N - 1) as f32).cos()).max(1.0e-3))
        .collect()
}

/// Blends one image's denoised tiles into the canvas, weighting each by a 2-D Hann window, then
/// crops to the requested size and converts to metres.
fn blend_tiles(rows: &[f32], layout: &Layout) -> Vec<f32> {
    let (ch, cw) = layout.canvas;
    let window = hann();
    let mut sum = vec![0f32; ch * cw];
    let mut weight = vec![0f32; ch * cw];
    for (t, &(y, x)) in layout.tiles.iter().enumerate() {
        let tile = &rows[t * N * N..][..N * N];
        for dy in 0..N {
            for dx in 0..N {
                let w = window[dy] * window[dx];
                let i = (y + dy) * cw + x + dx;
                sum[i] += tile[dy * N + dx] * w;
                weight[i] += w;
            }
        }
    }
    let mut out = Vec::with_capacity(layout.width * layout.height);
    for yy in 0..layout.height {
        for xx in 0..layout.width {
            let i = yy * cw + xx;
            out.push(to_height(sum[i] / weight[i].max(1.0e-12)));
        }
    }
    zero_floor(&mut out);
    out
}

/// Bilinear resize with half-pixel centres, as the package's `_resize`.
fn resize_bilinear(src: &[f32], (sh, sw): (usize, usize), (dh, dw): (usize, usize)) -> Vec<f32> {
    if (sh, sw) == (dh, dw) {
        return src.to_vec();
    }
    let axis = |out: usize, inp: usize| -> Vec<(usize, usize, f32)> {
        (0..out)
            .map(|i| {
                let p = ((i as f32 + 0.5) * inp as f32 / out as f32 - 0.5).clamp(0.0, (inp - 1) as f32);
                let p0 = p.floor() as usize;
                (p0, (p0 + 1).min(inp - 1), p - p0 as f32)
            })
            .collect()
    };
    let (xs, ys) = (axis(dw, sw), axis(dh, sh));
    let mut out = Vec::with_capacity(dh * dw);
    for &(y0, y1, wy) in &ys {
        for &(x0, x1, wx) in &xs {
            let top = src[y0 * sw + x0] * (1.0 - wx) + src[y0 * sw + x1] * wx;
            let bottom = src[y1 * sw + x0] * (1.0 - wx) + src[y1 * sw + x1] * wx;
            out.push((top * (1.0 - wy) + bottom * wy).clamp(0.0, HEIGHT_RANGE));
        }
    }
    out
}

/// Colour ramp stops (position, RGB), after matplotlib's `terrain`.
const RAMP: [(f32, [f32; 3]); 6] = [
    (0.00, [0.20, 0.20, 0.60]),
    (0.15, [0.00, 0.60, 1.00]),
    (0.25, [0.00, 0.80, 0.40]),
    (0.50, [1.00, 1.00, 0.60]),
    (0.75, [0.50, 0.36, 0.33]),
    (1.00, [1.00, 1.00, 1.00]),
];

fn ramp(t: f32) -> [f32; 3] {
    let t = t.clamp(0.0, 1.0);
    let i = RAMP.iter().position(|(p, _)| *p >= t).unwrap_or(RAMP.len() - 1).max(1);
    let ((p0, c0), (p1, c1)) = (RAMP[i - 1], RAMP[i]);
    let f = if p1 > p0 { (t - p0) / (p1 - p0) } else { 0.0 };
    [0, 1, 2].map(|k| c0[k] + (c1[k] - c0[k]) * f)
}

/// The ramp sampled at `LUT_SIZE` points: rendering looks colours up instead of searching.
const LUT_SIZE: usize = 1024;

fn ramp_lut() -> &'static [[f32; 3]; LUT_SIZE] {
    static LUT: std::sync::LazyLock<[[f32; 3]; LUT_SIZE]> =
        std::sync::LazyLock::new(|| std::array::from_fn(|i| ramp(i as f32 / (LUT_SIZE - 1) as f32)));
    &LUT
}

/// Encodes heights (metres) as PNG: a hill-shaded colour map, or 16-bit grey where 65535 is
/// [`HEIGHT_RANGE`] metres (so simulators can recover heights).
fn render(heights: &[f32], width: usize, height: usize, colormap: Colormap) -> Result<Image, String> {
    match colormap {
        Colormap::Grey => {
            let values: Vec<u16> = heights
                .iter()
                .map(|h| ((h / HEIGHT_RANGE).clamp(0.0, 1.0) * 65535.0).round() as u16)
                .collect();
            encode::png_grey16(width as u32, height as u32, &values)
        }
        Colormap::Terrain => encode::png_rgb8(width as u32, height as u32, &shade(heights, width, height)),
    }
}

/// RGB of a heightfield: colour by height relative to the map's highest point, lit from the
/// north-west at 45° (cells 0.1 m apart, as the package renders).
fn shade(heights: &[f32], width: usize, height: usize) -> Vec<u8> {
    let lut = ramp_lut();
    let max = heights.iter().copied().fold(0f32, f32::max).max(1.0e-6);
    let to_index = (LUT_SIZE - 1) as f32 / max;
    let (lx, ly, lz) = (-0.5f32, -0.5f32, std::f32::consts::FRAC_1_SQRT_2);
    let mut rgb = vec![0u8; width * height * 3];
    for y in 0..height {
        let row = &heights[y * width..][..width];
        let up = &heights[y.saturating_sub(1) * width..][..width];
        let down = &heights[(y + 1).min(height - 1) * width..][..width];
        let out = &mut rgb[y * width * 3..][..width * 3];
        for x in 0..width {
            let dzdx = (row[(x + 1).min(width - 1)] - row[x.saturating_sub(1)]) * 5.0;
            let dzdy = (down[x] - up[x]) * 5.0;
            let shade = ((-dzdx * lx - dzdy * ly + lz) / (dzdx * dzdx + dzdy * dzdy + 1.0).sqrt()).max(0.0);
            let light = (0.55 + 0.45 * shade) * 255.0;
            let c = lut[((row[x] * to_index) as usize).min(LUT_SIZE - 1)];
            out[x * 3] = (c[0] * light).min(255.0) as u8;
            out[x * 3 + 1] = (c[1] * light).min(255.0) as u8;
            out[x * 3 + 2] = (c[2] * light).min(255.0) as u8;
        }
    }
    rgb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_starts_match_the_package() {
        // generator.py: range(0, length - 128 + 1, 96) plus the final flush tile.
        assert_eq!(tile_starts(128, 32), vec![0]);
        assert_eq!(tile_starts(256, 32), vec![0, 96, 128]);
        assert_eq!(tile_starts(512, 32), vec![0, 96, 192, 288, 384]);
        assert_eq!(tile_starts(2048, 32).len(), 21);
        assert_eq!(tile_starts(200, 0), vec![0, 72]);
    }

    #[test]
    fn larger_maps_need_more_rows() {
        assert_eq!(Layout::of(64, 100, 1, 32).rows(), 1);
        assert_eq!(Layout::of(128, 128, 3, 32).rows(), 3);
        assert_eq!(Layout::of(512, 512, 1, 32).rows(), 25);
        assert_eq!(Layout::of(512, 128, 2, 32).rows(), 10);
        assert_eq!(Layout::of(2048, 2048, 1, 32).rows(), 441);
    }

    #[test]
    fn blending_constant_tiles_gives_a_constant_map() {
        let layout = Layout::of(300, 200, 1, 32);
        let rows = vec![0.25f32; layout.rows() * N * N];
        let h = blend_tiles(&rows, &layout);
        assert_eq!(h.len(), 300 * 200);
        assert!(h.iter().all(|v| v.abs() < 1e-4), "zero-floored constant");
    }

    #[test]
    fn the_height_table_matches_the_exact_curve() {
        for i in 0..=20_000 {
            let v = i as f32 / 10_000.0 - 1.0;
            assert!(
                (to_height(v) - to_height_exact(v)).abs() < 2e-5,
                "{v}: {} vs {}",
                to_height(v),
                to_height_exact(v)
            );
        }
    }

    #[test]
    fn heights_stay_in_range() {
        assert_eq!(to_height(-1.0), 0.0);
        assert!((to_height(1.0) - HEIGHT_RANGE).abs() < 1e-3);
        assert!(to_height(0.0) > 0.0 && to_height(0.0) < HEIGHT_RANGE);
    }

    #[test]
    fn resize_keeps_values_and_size() {
        let src: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let out = resize_bilinear(&src, (4, 4), (2, 8));
        assert_eq!(out.len(), 16);
        assert!(out.iter().all(|v| (0.0..=15.0).contains(v)));
        assert_eq!(resize_bilinear(&src, (4, 4), (4, 4)), src);
    }

    #[test]
    fn ramp_ends() {
        assert_eq!(ramp(0.0), RAMP[0].1);
        assert_eq!(ramp(1.0), RAMP[5].1);
        assert_eq!(ramp_lut()[0], RAMP[0].1);
        assert_eq!(ramp_lut()[LUT_SIZE - 1], RAMP[5].1);
    }

    #[test]
    fn flat_ground_is_lit_evenly_and_peaks_are_white() {
        let flat = vec![0.0f32; 16];
        let rgb = shade(&flat, 4, 4);
        assert!(rgb.chunks(3).all(|p| p == &rgb[..3]), "one colour on flat ground");
        let mut peak = vec![0.0f32; 9];
        peak[4] = 10.0;
        let rgb = shade(&peak, 3, 3);
        let centre = &rgb[12..15];
        assert!(centre[0] > 200 && centre[1] > 200 && centre[2] > 200, "{centre:?}");
    }
}
