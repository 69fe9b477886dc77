//! What an image carries from one sampler step to the next beyond its latents, so that images of
//! one batch stop, start and carry on in other calls independently of each other.

/// Per-image solver state (the multistep solver's previous prediction).
#[derive(Debug, Clone, Default)]
pub struct ImageState {
    pub(super) previous: Option<Vec<f32>>,
    pub(super) lower_order_nums: usize,
}

impl ImageState {
    /// The state of an image that has run `ran` steps, carried out of one call and into another:
    /// the multistep solver's previous prediction (none before the first step). Its order rises
    /// by one a step up to two, so `ran` gives it back.
    pub fn resumed(previous: Option<Vec<f32>>, ran: usize) -> ImageState {
        ImageState {
            lower_order_nums: if previous.is_some() { ran.min(2) } else { 0 },
            previous,
        }
    }

    /// The multistep solver's previous prediction, once it has one.
    pub fn previous(&self) -> Option<&[f32]> {
        self.previous.as_deref()
    }
}
