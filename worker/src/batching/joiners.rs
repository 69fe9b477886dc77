//! A running set's joiners, made ready while the set's calls run: asked for at a step boundary,
//! they are prepared (their input images read, their start recorded by the crash guard: a commit
//! round trip) while the set's next call runs, and join at the first boundary after they are
//! ready. The set never waits at a boundary for a joiner's preparation; a joiner that is ready
//! at once joins at once.

use std::future::Future;

use futures::FutureExt;
use futures::future::BoxFuture;

/// Where a running batch of a step-by-step bucket finds the tasks that join it at a step
/// boundary: those of its lane and bucket that arrived since it started, made ready to run.
pub trait Joining<T>: Send {
    /// Up to `room` tasks ready to join the running batch's next call, without waiting for any
    /// to come. `room` 0: the batch takes no more for now.
    fn more(&mut self, room: usize) -> BoxFuture<'_, Vec<T>>;
}

/// The asking in flight: it hands the source back with the tasks it got.
type Asked<'a, T> = BoxFuture<'a, (&'a mut dyn Joining<T>, Vec<T>)>;

enum State<'a, T> {
    Idle(&'a mut dyn Joining<T>),
    Asked(Asked<'a, T>),
    /// Only while moving from one to the other.
    Moving,
}

pub(super) struct Joiners<'a, T> {
    state: State<'a, T>,
    /// Prepared, not joined yet.
    ready: Vec<T>,
}

impl<'a, T: Send + 'a> Joiners<'a, T> {
    pub fn new(source: &'a mut dyn Joining<T>) -> Joiners<'a, T> {
        Joiners {
            state: State::Idle(source),
            ready: Vec::new(),
        }
    }

    /// At a step boundary: up to `room` tasks ready to join now. Unless an asking is in flight,
    /// it asks for the room left (0 tells the source the set takes no more for now), and what
    /// that asking has ready at once joins now too.
    pub fn ready(&mut self, room: usize) -> Vec<T> {
        self.poll();
        let mut joined = self.take(room);
        if matches!(self.state, State::Idle(_)) {
            let left = room - joined.len();
            self.ask(left);
            self.poll();
            joined.extend(self.take(left));
        }
        joined
    }

    /// Runs `work` (the set's next call), the asking in flight making progress meanwhile.
    pub async fn during<F: Future>(&mut self, work: F) -> F::Output {
        let mut work = std::pin::pin!(work);
        loop {
            let State::Asked(asked) = &mut self.state else {
                return work.await;
            };
            let got = tokio::select! {
                biased;
                out = &mut work => return out,
                got = asked => got,
            };
            self.answered(got);
        }
    }

    /// Once the set has stopped: waits for the asking in flight, and gives back every task
    /// prepared and not joined. They have been marked started: they must run.
    pub async fn settle(&mut self) -> Vec<T> {
        if let State::Asked(asked) = &mut self.state {
            let got = asked.await;
            self.answered(got);
        }
        std::mem::take(&mut self.ready)
    }

    fn take(&mut self, room: usize) -> Vec<T> {
        let n = room.min(self.ready.len());
        self.ready.drain(..n).collect()
    }

    fn ask(&mut self, room: usize) {
        let State::Idle(source) = std::mem::replace(&mut self.state, State::Moving) else {
            unreachable!("asked while asking")
        };
        self.state = State::Asked(Box::pin(async move {
            let more = source.more(room).await;
            (source, more)
        }));
    }

    fn poll(&mut self) {
        if let State::Asked(asked) = &mut self.state
            && let Some(got) = asked.as_mut().now_or_never()
        {
            self.answered(got);
        }
    }

    fn answered(&mut self, (source, more): (&'a mut dyn Joining<T>, Vec<T>)) {
        self.ready.extend(more);
        self.state = State::Idle(source);
    }
}
