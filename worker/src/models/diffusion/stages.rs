//! What the UNet and the flow backends both run: a text encoder's call, classifier-free guidance,
//! the VAE decode (one image at a time when the batch runs out of memory), a call's rows, its
//! cancellations and its outputs.

use std::sync::Arc;

use crate::engine::{Backend, Call, EngineError, OrtBackend, Tensor};

/// Decodes unscaled latents [n, ...] to images in [0, 1] with `vae_decoder`: `latent_sample` =
/// `latents / scaling + shift`, `sample / 2 + 0.5` clamped. One image at a time when the whole
/// batch runs out of memory (the classic high-resolution OOM), so a batch whose denoising fit is
/// not thrown away for its decode.
pub(in crate::models::diffusion) fn vae_decode(
    vae: &mut OrtBackend,
    latents: &[f32],
    shape: &[usize],
    scaling: f32,
    shift: f32,
) -> Result<Vec<f32>, EngineError> {
    let scaled: Vec<f32> = latents.iter().map(|v| v / scaling + shift).collect();
    let n = shape[0];
    let run = |vae: &mut OrtBackend, data: Vec<f32>, rows: usize| -> Result<Vec<f32>, EngineError> {
        let mut s = shape.to_vec();
        s[0] = rows;
        let out = vae.run_tensors(&[Tensor::f32("latent_sample", s, data)])?;
        let sample = out
            .into_iter()
            .next()
            .ok_or_else(|| EngineError::Run("vae_decoder has no output".into()))?;
        match sample.data {
            crate::engine::TensorData::F32(v) => Ok(v.into_iter().map(|x| (x / 2.0 + 0.5).clamp(0.0, 1.0)).collect()),
            crate::engine::TensorData::I64(_) => Err(EngineError::Run("vae_decoder output is not float32".into())),
        }
    };
    match run(vae, scaled.clone(), n) {
        Err(EngineError::OutOfMemory(message)) if n > 1 => {
            tracing::warn!(images = n, error = %message, "VAE decode ran out of memory; decoding one image at a time");
            vae.release_memory();
            let per = scaled.len() / n;
            let mut images = Vec::new();
            for chunk in scaled.chunks(per) {
                images.extend(run(vae, chunk.to_vec(), 1)?);
            }
            Ok(images)
        }
        other => other,
    }
}

/// Which hidden states of a text encoder a pipeline reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::models::diffusion) enum Hidden {
    /// `last_hidden_state` (SD 1.x/2.x).
    Last,
    /// `hidden_states[-2]`, the penultimate layer's (SDXL, both encoders).
    Penultimate,
}

/// Runs `encoder` on the token ids `ids` [n, seq], each distinct row once. Returns, per row, the
/// `hidden` states [seq, d], and the output named `pooled` [p] if asked for (`text_embeds`, a
/// projection's pooled output; `pooler_output`, CLIP's own).
pub(in crate::models::diffusion) fn encode(
    encoder: &mut OrtBackend,
    ids: &Tensor,
    hidden: Hidden,
    pooled: Option<&str>,
) -> Result<(Vec<f32>, Option<Vec<f32>>), EngineError> {
    let seq = ids.shape[1];
    let all = ids
        .i64_rows(0, ids.rows())
        .ok_or_else(|| EngineError::Run("token ids must be int64".into()))?;
    let (distinct, index) = distinct_rows(all.chunks(seq.max(1)));
    let batch = Tensor::i64("input_ids", vec![distinct.len(), seq], distinct.concat());
    let out = encoder.run_tensors(&[batch])?;
    let name = match hidden {
        Hidden::Last => "last_hidden_state".to_owned(),
        Hidden::Penultimate => {
            let layers = out
                .iter()
                .filter_map(|t| t.name.strip_prefix("hidden_states.")?.parse::<usize>().ok())
                .max()
                .filter(|&last| last >= 1)
                .ok_or_else(|| EngineError::Run("text encoder has no `hidden_states.N` outputs (SDXL reads the penultimate)".into()))?;
            format!("hidden_states.{}", layers - 1)
        }
    };
    let per_row = |name: &str| -> Result<Vec<f32>, EngineError> {
        let t = out
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| EngineError::Run(format!("text encoder has no `{name}` output")))?;
        let rows: Vec<&[f32]> = index
            .iter()
            .map(|&i| {
                t.f32_rows(i, i + 1)
                    .ok_or_else(|| EngineError::Run(format!("`{name}` is not float32")))
            })
            .collect::<Result<_, _>>()?;
        Ok(rows.concat())
    };
    Ok((per_row(&name)?, pooled.map(per_row).transpose()?))
}

/// Two encoders' hidden states joined along the features of each of `tokens` tokens, as SDXL's
/// `torch.concat(prompt_embeds_list, dim=-1)`.
pub(in crate::models::diffusion) fn join_features(a: &[f32], b: &[f32], tokens: usize) -> Result<Vec<f32>, EngineError> {
    if tokens == 0 || !a.len().is_multiple_of(tokens) || !b.len().is_multiple_of(tokens) {
        return Err(EngineError::Run(format!(
            "text encoders gave {} and {} values for {tokens} tokens",
            a.len(),
            b.len()
        )));
    }
    let (da, db) = (a.len() / tokens, b.len() / tokens);
    Ok(a.chunks(da)
        .zip(b.chunks(db))
        .flat_map(|(x, y)| x.iter().chain(y).copied())
        .collect())
}

pub(in crate::models::diffusion) fn input<'a>(call: &'a Call, name: &str) -> Result<&'a Tensor, EngineError> {
    call.inputs
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| EngineError::Run(format!("stable diffusion call without `{name}`")))
}

/// Which task owns each of the call's `n` image rows.
pub(in crate::models::diffusion) fn row_owners(call: &Call, n: usize) -> Result<Vec<usize>, EngineError> {
    let owner: Vec<usize> = call
        .tasks
        .iter()
        .enumerate()
        .flat_map(|(t, task)| std::iter::repeat_n(t, task.rows))
        .collect();
    if owner.len() != n {
        return Err(EngineError::Run(format!("tasks own {} rows, the call has {n}", owner.len())));
    }
    Ok(owner)
}

/// Each row's step range, `begin..end`: `step_begin`/`step_end` [n] int64 when the call has them,
/// else `first..steps` (every step the schedule runs). A range starts at `first` or later and ends
/// at `steps` or sooner, so rows that started at other times can share a call and a row can stop
/// early (its state is then the call's output, to be fed back later).
pub(in crate::models::diffusion) fn step_ranges(
    call: &Call,
    n: usize,
    first: usize,
    steps: usize,
) -> Result<(Vec<usize>, Vec<usize>), EngineError> {
    let read = |name: &str, default: usize| -> Result<Vec<usize>, EngineError> {
        let Ok(t) = input(call, name) else { return Ok(vec![default; n]) };
        let values = t
            .i64_rows(0, t.rows())
            .ok_or_else(|| EngineError::Run(format!("`{name}` must be int64")))?;
        if values.len() != n {
            return Err(EngineError::Run(format!("`{name}` has {} values for {n} rows", values.len())));
        }
        values
            .iter()
            .map(|&v| usize::try_from(v).ok().filter(|&v| (first..=steps).contains(&v)))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| EngineError::Run(format!("`{name}` must be within {first}..={steps}")))
    };
    let (begin, end) = (read("step_begin", first)?, read("step_end", steps)?);
    if begin.iter().zip(&end).any(|(b, e)| b > e) {
        return Err(EngineError::Run("a row's step_begin is after its step_end".into()));
    }
    Ok((begin, end))
}

/// `name` [n, ...] as `per_row` floats a row, checked.
pub(in crate::models::diffusion) fn row_values<'a>(call: &'a Call, name: &str, n: usize, per_row: usize) -> Result<&'a [f32], EngineError> {
    let values = input(call, name)?.floats()?;
    match values.len() == n * per_row {
        true => Ok(values),
        false => Err(EngineError::Run(format!(
            "`{name}` has {} values, expected {n}x{per_row}",
            values.len()
        ))),
    }
}

/// Rows that begin after the bucket's `first` step (`at`, from [`step_ranges`]) carry on where an
/// earlier call left them: their rows of `latents` (`per_row` values each) become their
/// `step_latents`, that call's `latents` output. Other rows keep theirs; a call with none needs
/// no `step_latents`.
pub(in crate::models::diffusion) fn resume_latents(
    call: &Call,
    at: &[usize],
    first: usize,
    per_row: usize,
    latents: &mut [f32],
) -> Result<(), EngineError> {
    if at.iter().all(|&i| i == first) {
        return Ok(());
    }
    let resumed = row_values(call, "step_latents", at.len(), per_row)?;
    for (r, _) in at.iter().enumerate().filter(|&(_, &i)| i > first) {
        let span = r * per_row..(r + 1) * per_row;
        latents[span.clone()].copy_from_slice(&resumed[span]);
    }
    Ok(())
}

/// The images of the rows that ran their bucket's last step (`finished`), from `decode` of their
/// latents ([n, ...] of `latent_shape`); `image_values` a row. The other rows carry on in a later
/// call, which gives their images: theirs are zeros here, and when no row finished nothing is
/// decoded.
pub(in crate::models::diffusion) fn decode_finished(
    latents: &[f32],
    latent_shape: &[usize],
    finished: &[bool],
    image_values: usize,
    decode: impl FnOnce(&[f32], &[usize]) -> Result<Vec<f32>, EngineError>,
) -> Result<Vec<f32>, EngineError> {
    let n = finished.len();
    let rows: Vec<usize> = (0..n).filter(|&r| finished[r]).collect();
    if rows.is_empty() {
        return Ok(vec![0.0; n * image_values]);
    }
    let mut shape = latent_shape.to_vec();
    shape[0] = rows.len();
    let decoded = match rows.len() == n {
        true => decode(latents, &shape)?,
        false => {
            let per = latents.len() / n;
            let some: Vec<f32> = rows.iter().flat_map(|&r| latents[r * per..(r + 1) * per].iter().copied()).collect();
            decode(&some, &shape)?
        }
    };
    if decoded.len() != rows.len() * image_values {
        return Err(EngineError::Run(format!(
            "vae_decoder gave {} values for {} images of {image_values}",
            decoded.len(),
            rows.len()
        )));
    }
    if rows.len() == n {
        return Ok(decoded);
    }
    let mut images = vec![0.0; n * image_values];
    for (image, &r) in decoded.chunks(image_values).zip(&rows) {
        images[r * image_values..(r + 1) * image_values].copy_from_slice(image);
    }
    Ok(images)
}

/// A call's outputs, the same for every diffusion backend: `images` [n, 3, H, W] in [0, 1],
/// `latents` (the final, unscaled latents) and `cancelled` [n] (1 for the rows of a task
/// cancelled mid-loop; `owner` names each row's task).
pub(in crate::models::diffusion) fn call_outputs(
    (images, image_shape): (Vec<f32>, Vec<usize>),
    (latents, latent_shape): (Vec<f32>, Vec<usize>),
    owner: &[usize],
    cancelled: &[bool],
) -> Vec<Tensor> {
    let cancelled_rows: Vec<f32> = owner.iter().map(|&t| if cancelled[t] { 1.0 } else { 0.0 }).collect();
    vec![
        Tensor::f32("images", image_shape, images),
        Tensor::f32("latents", latent_shape, latents),
        Tensor::f32("cancelled", vec![owner.len()], cancelled_rows),
    ]
}

/// Classifier-free guidance: `uncond + g * (cond - uncond)`, as diffusers combines the two
/// predictions.
pub(in crate::models::diffusion) fn guided(uncond: &[f32], cond: &[f32], g: f32) -> Vec<f32> {
    uncond.iter().zip(cond).map(|(u, c)| u + g * (c - u)).collect()
}

/// Marks the tasks whose clients cancelled them since the last step.
pub(in crate::models::diffusion) fn note_cancellations(call: &Call, cancelled: &mut [bool]) {
    for (task, hooks) in call.tasks.iter().enumerate().filter_map(|(k, t)| t.hooks.as_ref().map(|h| (k, h))) {
        if !cancelled[task] && hooks.cancelled() {
            cancelled[task] = true;
        }
    }
}

/// Tells each task that ran a step (it owns one of the `active` rows) and is still running the
/// step its rows have reached, of the steps its bucket runs (`first..steps`; a task's rows run
/// together, so its first active row's step is the task's).
pub(in crate::models::diffusion) fn report_progress(
    call: &Call,
    cancelled: &[bool],
    active: &[usize],
    owner: &[usize],
    at: &[usize],
    (first, steps): (usize, usize),
) {
    for (task, hooks) in call.tasks.iter().enumerate().filter_map(|(k, t)| t.hooks.as_ref().map(|h| (k, h))) {
        if let Some(&row) = active.iter().find(|&&r| owner[r] == task).filter(|_| !cancelled[task]) {
            hooks.progress(at[row] - first, steps - first);
        }
    }
}

/// The distinct rows of `rows` in first-seen order, and the index of each row among them.
pub(in crate::models::diffusion) fn distinct_rows<'a, T: PartialEq + 'a>(
    rows: impl Iterator<Item = &'a [T]>,
) -> (Vec<&'a [T]>, Vec<usize>) {
    let mut distinct: Vec<&[T]> = Vec::new();
    let index = rows
        .map(|row| {
            distinct.iter().position(|d| *d == row).unwrap_or_else(|| {
                distinct.push(row);
                distinct.len() - 1
            })
        })
        .collect();
    (distinct, index)
}

/// What a backend made of some of a call's inputs (its prompts' encodings, its init images'
/// latents), kept for the next call of the bucket with the same inputs: a batch that runs a few
/// steps a call ([`crate::engine::Stepped`]) encodes its prompts and images once, not every call.
pub(in crate::models::diffusion) struct Reuse<T> {
    names: &'static [&'static str],
    last: Option<(String, Vec<Tensor>, Arc<T>)>,
}

impl<T> Reuse<T> {
    /// Made from the inputs named `names` (those a call has) and the call's bucket.
    pub(in crate::models::diffusion) fn of(names: &'static [&'static str]) -> Reuse<T> {
        Reuse { names, last: None }
    }

    fn inputs<'a>(&self, call: &'a Call) -> impl Iterator<Item = &'a Tensor> {
        self.names.iter().filter_map(|n| call.inputs.iter().find(|t| t.name == *n))
    }

    /// The last value, if `call` has the same bucket and inputs as the call it was made for.
    pub(in crate::models::diffusion) fn hit(&self, call: &Call) -> Option<Arc<T>> {
        let (key, inputs, value) = self.last.as_ref()?;
        (key == call.key.name() && self.inputs(call).eq(inputs.iter())).then(|| value.clone())
    }

    /// Keeps `value`, made for `call`, in place of the last.
    pub(in crate::models::diffusion) fn keep(&mut self, call: &Call, value: T) -> Arc<T> {
        let value = Arc::new(value);
        let inputs = self.inputs(call).cloned().collect();
        self.last = Some((call.key.name().to_owned(), inputs, value.clone()));
        value
    }

    /// Forgets the last value (its memory goes back with the sessions').
    pub(in crate::models::diffusion) fn clear(&mut self) {
        self.last = None;
    }
}
