//! What the tasks of one model call share, in the model adapter's own type: the bucket key.
//!
//! The pipeline groups, orders and names buckets by the key's name; the model's backend reads the
//! key back from the call as the type its adapter made it (Stable Diffusion's size, sampler,
//! steps and guidance), never by parsing text. A new model family brings its own key type.
//!
//! A key may also say that its model runs a call's rows a step at a time and can stop after any
//! step ([`Stepped`]): the batcher then runs a long call as several calls of a few steps each,
//! each taking its own turn at the device, the rows' state carried from one into the next.

use std::any::Any;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::sync::{Arc, LazyLock};

/// A bucket key: a value of the adapter's type, its name, and the pixels of one image where the
/// key knows them (the metric label's size class).
#[derive(Clone)]
pub struct CallKey {
    name: Arc<str>,
    pixels: Option<u64>,
    value: Arc<dyn Any + Send + Sync>,
    stepped: Option<Arc<Stepped>>,
}

/// How a bucket's calls run step by step: the steps a call runs, and what a call that stopped
/// early hands the next. A call's rows take `step_begin`/`step_end` [n] int64 inputs; each
/// `(output, input)` of `carry` is an output of a call that stopped before the last step that the
/// next call takes as that input (a diffusion row's latents and its sampler's state).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stepped {
    pub steps: Range<usize>,
    pub carry: &'static [(&'static str, &'static str)],
    /// Every how many steps a task's carried state is kept outside the process (durable
    /// checkpoints), where the model's catalog entry asks for it.
    pub checkpoint_every: Option<usize>,
    /// How long after a task's state was last kept (or its run began) it is kept again,
    /// whatever the steps (the catalog's `checkpoint_every_seconds`).
    pub checkpoint_seconds: Option<std::time::Duration>,
}

impl Stepped {
    /// Whether the bucket keeps its tasks' state outside the process at all.
    pub fn keeps_checkpoints(&self) -> bool {
        self.checkpoint_every.is_some() || self.checkpoint_seconds.is_some()
    }
}

impl CallKey {
    /// No more than the model: every task of it can share a call. One shared value: a model
    /// that needs no key asks for it once per task.
    pub fn none() -> CallKey {
        static NONE: LazyLock<CallKey> = LazyLock::new(|| CallKey {
            name: Arc::from(""),
            pixels: None,
            value: Arc::new(()),
            stepped: None,
        });
        NONE.clone()
    }

    /// `key`, named by its `Display`.
    pub fn new<K: Any + Send + Sync + fmt::Display>(key: K, pixels: Option<u64>) -> CallKey {
        CallKey {
            name: Arc::from(key.to_string()),
            pixels,
            value: Arc::new(key),
            stepped: None,
        }
    }

    /// The key of a model that runs calls step by step ([`Stepped`]).
    pub fn stepped(mut self, stepped: Stepped) -> CallKey {
        self.stepped = Some(Arc::new(stepped));
        self
    }

    /// How calls of the bucket run step by step, where they can.
    pub fn steps(&self) -> Option<&Stepped> {
        self.stepped.as_deref()
    }

    /// The key as its adapter made it; `None` if it is of another type.
    pub fn get<K: Any>(&self) -> Option<&K> {
        self.value.downcast_ref()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Pixels of one image of the bucket, where the key knows them.
    pub fn pixels(&self) -> Option<u64> {
        self.pixels
    }
}

impl fmt::Display for CallKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl fmt::Debug for CallKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.name)
    }
}

impl PartialEq for CallKey {
    fn eq(&self, other: &CallKey) -> bool {
        self.name == other.name
    }
}

impl Eq for CallKey {}

impl Hash for CallKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl PartialOrd for CallKey {
    fn partial_cmp(&self, other: &CallKey) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for CallKey {
    fn cmp(&self, other: &CallKey) -> Ordering {
        self.name.cmp(&other.name)
    }
}
