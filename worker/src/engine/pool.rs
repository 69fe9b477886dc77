//! Engine threads and the device gate.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Instant;

use sluice_schemas::Priority;
use tokio::sync::oneshot;

use super::gate::Gate;
use super::turns::Turn;
use super::{Backend, Call, EngineError, Placement, Tensor};
use crate::panics;

/// Builds one backend of a model; called once on every engine thread.
pub type Loader = Arc<dyn Fn() -> Result<Box<dyn Backend>, EngineError> + Send + Sync>;

enum Command {
    Run {
        model: String,
        call: Call,
        reply: oneshot::Sender<Result<Vec<Tensor>, EngineError>>,
    },
    Load {
        model: String,
        loader: Loader,
        reply: oneshot::Sender<Result<Placement, EngineError>>,
    },
    Unload {
        model: String,
        reply: oneshot::Sender<bool>,
    },
    ReleaseMemory {
        model: String,
    },
    /// Drops every session of every model.
    DropAll {
        reply: oneshot::Sender<()>,
    },
}

/// Handle to the engine threads. Cheap to clone; the threads stop when the last handle is dropped.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    slots: Vec<std_mpsc::Sender<Command>>,
    /// Slots any lane's calls take (the rest are kept for the interactive lane).
    shared: usize,
    idle: Mutex<Vec<usize>>,
    gate: Gate,
    /// How each loaded model was loaded, for [`Engine::rebuild`].
    loaders: Mutex<HashMap<String, Loader>>,
}

impl Engine {
    /// Starts `slots` engine threads (at least one).
    pub fn start(slots: usize) -> Engine {
        Engine::start_with_kept(slots, 0)
    }

    /// Starts `slots` engine threads (at least one) and `kept` more that only the interactive
    /// lane's calls (and exclusive runs) use: an interactive call runs beside whatever holds
    /// the shared slots ([`super::gate`]). Every thread holds its own session of every model.
    pub fn start_with_kept(slots: usize, kept: usize) -> Engine {
        let shared = slots.max(1);
        let slots = shared + kept;
        let senders = (0..slots)
            .map(|i| {
                let (tx, rx) = std_mpsc::channel();
                thread::Builder::new()
                    .name(format!("sluice-engine-{i}"))
                    .spawn(move || slot_main(rx))
                    .expect("spawn engine thread");
                tx
            })
            .collect();
        Engine {
            inner: Arc::new(Inner {
                slots: senders,
                shared,
                idle: Mutex::new((0..slots).rev().collect()),
                gate: Gate::new(shared as u32, kept as u32),
                loaders: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Engine threads every lane's calls take: the kept ones left out.
    pub fn shared_slots(&self) -> usize {
        self.inner.shared
    }

    /// Runs a batch of `model` on one engine thread, in its `turn` among the calls waiting for
    /// the device ([`super::turns`]). An `exclusive` run waits until no other run is on the
    /// device and keeps it to itself.
    pub async fn run(&self, model: &str, call: Call, exclusive: bool, turn: Turn) -> Result<Vec<Tensor>, EngineError> {
        Ok(self.run_timed(model, call, exclusive, turn).await?.0)
    }

    /// [`Engine::run`], and when its turn came (the wait for the device left out).
    pub async fn run_timed(&self, model: &str, call: Call, exclusive: bool, turn: Turn) -> Result<(Vec<Tensor>, Instant), EngineError> {
        let permits = if exclusive { self.inner.slots.len() as u32 } else { 1 };
        let _permit = self.inner.gate.acquire(permits, turn).await;
        let granted = Instant::now();
        let slot = self
            .inner
            .idle
            .lock()
            .expect("idle slots")
            .pop()
            .expect("a permit guarantees an idle slot");
        let _back = ReturnSlot { inner: &self.inner, slot };
        let (reply, rx) = oneshot::channel();
        self.inner.slots[slot]
            .send(Command::Run {
                model: model.to_owned(),
                call,
                reply,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok((rx.await.map_err(|_| EngineError::Stopped)??, granted))
    }

    /// Loads `model` on every engine thread. On failure, threads that did load it drop it again,
    /// so a model is either everywhere or nowhere.
    pub async fn load(&self, model: &str, loader: Loader) -> Result<Placement, EngineError> {
        let mut replies = Vec::new();
        for slot in &self.inner.slots {
            let (reply, rx) = oneshot::channel();
            slot.send(Command::Load {
                model: model.to_owned(),
                loader: loader.clone(),
                reply,
            })
            .map_err(|_| EngineError::Stopped)?;
            replies.push(rx);
        }
        let mut placement = None;
        let mut failure = None;
        for rx in replies {
            match rx.await.map_err(|_| EngineError::Stopped)? {
                Ok(p) => placement = Some(p),
                Err(e) => failure = Some(e),
            }
        }
        if let Some(e) = failure {
            self.unload(model).await;
            return Err(e);
        }
        self.inner.loaders.lock().expect("loaders").insert(model.to_owned(), loader);
        Ok(placement.expect("at least one slot"))
    }

    /// Drops every session of `model` on every engine thread and waits until they are gone.
    /// Returns whether any thread had it loaded.
    pub async fn unload(&self, model: &str) -> bool {
        self.inner.loaders.lock().expect("loaders").remove(model);
        let mut replies = Vec::new();
        for slot in &self.inner.slots {
            let (reply, rx) = oneshot::channel();
            if slot
                .send(Command::Unload {
                    model: model.to_owned(),
                    reply,
                })
                .is_ok()
            {
                replies.push(rx);
            }
        }
        let mut any = false;
        for rx in replies {
            any |= rx.await.unwrap_or(false);
        }
        any
    }

    /// Loads every model again from scratch, with nothing else on the device meanwhile: waits
    /// until no run is on it and keeps it to itself, drops every session of every model on
    /// every thread, calls `between` (nothing allocated by a session is alive then: the place
    /// to reset an arena), then loads each model as it was loaded. What the failed runs of an
    /// allocator left behind is gone afterwards, whatever the allocator. On an error a model may
    /// be left unloaded: the caller decides whether the process can still serve.
    pub async fn rebuild(&self, between: impl FnOnce() -> Result<(), EngineError>) -> Result<(), EngineError> {
        // First among those waiting: a rebuild is what a call in trouble waits for.
        let first = Turn {
            lane: Priority::Interactive,
            had: 0,
        };
        let _all = self.inner.gate.acquire(self.inner.slots.len() as u32, first).await;
        let mut loaders: Vec<(String, Loader)> = self
            .inner
            .loaders
            .lock()
            .expect("loaders")
            .iter()
            .map(|(m, l)| (m.clone(), l.clone()))
            .collect();
        loaders.sort_by(|a, b| a.0.cmp(&b.0));
        let mut replies = Vec::new();
        for slot in &self.inner.slots {
            let (reply, rx) = oneshot::channel();
            slot.send(Command::DropAll { reply }).map_err(|_| EngineError::Stopped)?;
            replies.push(rx);
        }
        for rx in replies {
            rx.await.map_err(|_| EngineError::Stopped)?;
        }
        between()?;
        for (model, loader) in loaders {
            self.load(&model, loader).await?;
        }
        Ok(())
    }

    /// Asks every session of `model` to give back unused arena memory on its next run.
    pub fn release_memory(&self, model: &str) {
        for slot in &self.inner.slots {
            let _ = slot.send(Command::ReleaseMemory { model: model.to_owned() });
        }
    }
}

struct ReturnSlot<'a> {
    inner: &'a Inner,
    slot: usize,
}

impl Drop for ReturnSlot<'_> {
    fn drop(&mut self) {
        self.inner.idle.lock().expect("idle slots").push(self.slot);
    }
}

fn slot_main(commands: std_mpsc::Receiver<Command>) {
    let mut models: HashMap<String, Box<dyn Backend>> = HashMap::new();
    while let Ok(command) = commands.recv() {
        match command {
            Command::Run { model, call, reply } => {
                let result = match models.get_mut(&model) {
                    // A panic fails this call only; the thread and its sessions carry on.
                    Some(backend) => panics::catch(|| backend.run(&call)).unwrap_or_else(|m| Err(EngineError::Panicked(m))),
                    None => Err(EngineError::Run(format!("model {model} is not loaded"))),
                };
                drop(call);
                let _ = reply.send(result);
            }
            Command::Load { model, loader, reply } => {
                // Drop the old sessions first: their memory must be free before the new ones load.
                models.remove(&model);
                let loaded = panics::catch(|| loader()).unwrap_or_else(|m| Err(EngineError::Load(m)));
                let result = loaded.map(|backend| {
                    let placement = backend.placement();
                    models.insert(model, backend);
                    placement
                });
                let _ = reply.send(result);
            }
            Command::Unload { model, reply } => {
                let _ = reply.send(models.remove(&model).is_some());
            }
            Command::ReleaseMemory { model } => {
                if let Some(backend) = models.get_mut(&model) {
                    backend.release_memory();
                }
            }
            Command::DropAll { reply } => {
                models.clear();
                let _ = reply.send(());
            }
        }
    }
}
