//! A node's engine thread: the synchronous engine lives on one OS thread and everything else
//! talks to it through one FIFO command channel, behind a cheap `Clone` handle. The loop is the
//! same for both roles: take every queued command, run one engine step while there is work,
//! publish, and block only when idle. Each role supplies its commands and its step.

use std::sync::mpsc;

use engine::engine::Engine;
use tokio::sync::oneshot;

use crate::error::NodeError;

/// What runs on a node's engine thread.
pub trait EngineTask: Send + 'static {
    type Command: Send + 'static;

    fn engine(&mut self) -> &mut Engine;

    /// Applies one command; replies travel in the command itself.
    fn handle(&mut self, command: Self::Command);

    /// One engine step; called only while the engine has work.
    fn step(&mut self);

    /// After every turn of the loop, and once before the first: publish load and gauges.
    /// Routers read free blocks from the first one, and a node that reported none would never
    /// be picked.
    fn publish(&mut self);

    /// The engine has no work and the thread is about to block for a command.
    fn idle(&mut self) {}
}

/// Sends commands to an engine thread. The thread ends when every sender is dropped.
pub struct Commands<C> {
    tx: mpsc::Sender<C>,
}

impl<C> Clone for Commands<C> {
    fn clone(&self) -> Self {
        Commands {
            tx: self.tx.clone(),
        }
    }
}

impl<C: Send + 'static> Commands<C> {
    pub fn send(&self, command: C) -> Result<(), NodeError> {
        self.tx.send(command).map_err(|_| NodeError::EngineStopped)
    }

    /// Sends the command `make` builds around a reply channel, and awaits the reply.
    pub async fn call<R>(
        &self,
        make: impl FnOnce(oneshot::Sender<R>) -> C,
    ) -> Result<R, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.send(make(reply))?;
        rx.await.map_err(|_| NodeError::EngineStopped)
    }
}

/// Starts `task` on a thread named `name`.
pub fn spawn<T: EngineTask>(name: &str, task: T) -> Commands<T::Command> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || run(task, rx))
        .expect("spawning the engine thread");
    Commands { tx }
}

fn run<T: EngineTask>(mut task: T, rx: mpsc::Receiver<T::Command>) {
    task.publish();
    loop {
        let first = if task.engine().has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            task.idle();
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        let mut next = first;
        while let Some(c) = next {
            task.handle(c);
            next = rx.try_recv().ok();
        }
        if task.engine().has_work() {
            task.step();
        }
        task.publish();
    }
}
