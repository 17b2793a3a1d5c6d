//! The CPU kernels' worker threads: one persistent pool whose workers spin between the ops of a
//! step and park when the engine goes quiet.
//!
//! A decode step of a 30-layer model runs about 150 parallel ops, most of them tens of
//! microseconds long. rayon parks its workers between them, and every fork-join then pays a
//! futex wake and a context switch (20-40 µs measured here, as long as a batch-1 projection).
//! Here a worker that has just finished a task keeps polling for the next one for
//! [`SPIN`], so within a step the hand-off is a cache-line read; after that it sleeps on a
//! condition variable, so an idle node costs no CPU.
//!
//! Tasks are claimed from a shared counter by the caller and the workers alike: a worker that
//! is slow to wake just claims fewer of them, and the caller never waits for a worker to start.
//! One op runs at a time; a second caller arriving while the pool is busy (another engine in
//! the same process) runs its tasks on its own thread rather than queue behind the first.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker polls before it parks: longer than the gaps between the ops of a
/// step (sampling and bookkeeping between steps take longer, and the workers may sleep then).
const SPIN: Duration = Duration::from_micros(200);

/// How long a wait polls without giving up its core. Past this a waiter yields between
/// polls: on a host with more busy threads than cores (two nodes on one machine, or a
/// neighbour's build), a thread spinning on a core keeps off it the very thread it waits for,
/// or another node's, for a whole scheduler time slice. The gaps between the ops of one
/// step are a few microseconds, so a quiet machine never reaches it.
const PURE_SPIN: Duration = Duration::from_micros(20);

/// Polls between clock reads: the clock is a vDSO call, 1.5% of a batch-32 decode step when
/// read on every poll.
const POLLS_PER_CLOCK: u32 = 64;

/// A wait that polls, then polls and yields, and reports when it has run past `limit`.
struct Backoff {
    started: Instant,
    polls: u32,
    yielding: bool,
}

impl Backoff {
    fn new() -> Self {
        Backoff {
            started: Instant::now(),
            polls: 0,
            yielding: false,
        }
    }

    /// One turn of the wait: false once `limit` has passed (checked every few polls).
    fn snooze(&mut self, limit: Duration) -> bool {
        self.polls += 1;
        if self.polls.is_multiple_of(POLLS_PER_CLOCK) {
            let waited = self.started.elapsed();
            if waited >= limit {
                return false;
            }
            self.yielding = waited >= PURE_SPIN;
        }
        if self.yielding {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
        true
    }
}

/// One op in flight: `tasks` calls of `f`, claimed through `next`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    /// Claims and runs tasks until none is left.
    fn work(&self) {
        loop {
            let t = self.next.fetch_add(1, SeqCst);
            if t >= self.tasks {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(t))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
            }
            self.done.fetch_add(1, SeqCst);
        }
    }
}

struct Shared {
    /// The op in flight (a `Job` on the caller's stack), or null.
    job: AtomicPtr<Job<'static>>,
    /// Workers that may be reading `job`: the caller returns only once it is 0.
    active: AtomicUsize,
    /// Bumped for every op, so a worker knows there is something new.
    epoch: AtomicU64,
    /// Workers asleep on `wake`.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
}

/// The pool: `threads - 1` workers plus whichever thread calls [`Pool::run`].
pub(crate) struct Pool {
    shared: &'static Shared,
    threads: usize,
    /// One op at a time.
    busy: Mutex<()>,
}

impl Pool {
    /// The process's pool, sized like rayon's (`RAYON_NUM_THREADS`, else one per core), so
    /// one setting governs every parallel op.
    pub(crate) fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| Pool::new(rayon::current_num_threads().max(1)))
    }

    fn new(threads: usize) -> Pool {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            active: AtomicUsize::new(0),
            epoch: AtomicU64::new(0),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        }));
        for i in 1..threads {
            std::thread::Builder::new()
                .name(format!("fission-kernel-{i}"))
                .spawn(move || worker(shared))
                .expect("spawning a kernel worker thread");
        }
        Pool {
            shared,
            threads,
            busy: Mutex::new(()),
        }
    }

    /// Threads an op can use, the caller's included.
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0..tasks)` across the pool and returns when every call has. A panic in any
    /// task is re-raised here, after the rest have finished.
    pub(crate) fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks <= 1 || self.threads == 1 {
            (0..tasks).for_each(f);
            return;
        }
        let _busy = match self.busy.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            // Another op holds the pool: this one runs where it is.
            Err(TryLockError::WouldBlock) => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let job = Job {
            f,
            tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
        };
        let s = self.shared;
        // SAFETY (lifetime erasure): `job` outlives every use of this pointer. Workers read it
        // only between `active += 1` and `active -= 1`, and this function clears the pointer
        // and then waits for `active == 0` before `job` goes out of scope (SeqCst orders the
        // worker's increment, its load of the pointer, our store and our check).
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        s.job.store(ptr, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if s.sleeping.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        job.work();
        // A worker still inside a task may have lost its core: past the pure spin, yield it
        // the one this thread holds.
        let mut wait = Backoff::new();
        while job.done.load(SeqCst) < tasks {
            wait.snooze(Duration::MAX);
        }
        s.job.store(std::ptr::null_mut(), SeqCst);
        while s.active.load(SeqCst) > 0 {
            wait.snooze(Duration::MAX);
        }
        if let Some(p) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Only test pools are dropped; the global one lives as long as the process.
        self.shared.shutdown.store(true, SeqCst);
        let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.wake.notify_all();
    }
}

fn worker(s: &'static Shared) {
    let mut seen = 0u64;
    loop {
        // Spin, then park, until there is a new op.
        let mut wait = Backoff::new();
        loop {
            if s.shutdown.load(SeqCst) {
                return;
            }
            if s.epoch.load(SeqCst) != seen {
                break;
            }
            if wait.snooze(SPIN) {
                continue;
            }
            let g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleeping.fetch_add(1, SeqCst);
            // Re-checked under the lock the caller notifies under: no wake-up is lost.
            let _g = s
                .wake
                .wait_while(g, |_| {
                    s.epoch.load(SeqCst) == seen && !s.shutdown.load(SeqCst)
                })
                .unwrap_or_else(|e| e.into_inner());
            s.sleeping.fetch_sub(1, SeqCst);
        }
        seen = s.epoch.load(SeqCst);
        s.active.fetch_add(1, SeqCst);
        let job = s.job.load(SeqCst);
        if !job.is_null() {
            // SAFETY: non-null while `active` counts us: the caller waits for 0 before the
            // job it points to is dropped.
            unsafe { (*job).work() };
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

/// Runs `f(0..tasks)` on the process's kernel threads (the caller's among them) and returns
/// when every call has: the one parallel region of every CPU op, so that the engine's own
/// loops share the kernels' spinning threads instead of waking another pool.
pub fn parallel_for(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    run(tasks, f)
}

/// Threads [`parallel_for`] spreads over, the caller's included.
pub fn pool_threads() -> usize {
    threads()
}

pub(crate) fn run(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    Pool::global().run(tasks, f)
}

/// Threads the process's kernel pool has, the caller's included.
pub(crate) fn threads() -> usize {
    Pool::global().threads()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once() {
        let pool = Pool::new(3);
        for tasks in [0, 1, 2, 3, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            pool.run(tasks, &|t| {
                hits[t].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "{tasks} tasks");
        }
    }

    #[test]
    fn ops_after_the_workers_park_still_run() {
        let pool = Pool::new(2);
        let sum = AtomicUsize::new(0);
        for round in 0..3 {
            // Past the spin: the worker is asleep and must be woken.
            std::thread::sleep(SPIN * 5);
            pool.run(4, &|t| {
                sum.fetch_add(t + 1, SeqCst);
            });
            assert_eq!(sum.load(SeqCst), 10 * (round + 1));
        }
    }

    #[test]
    fn concurrent_callers_each_get_all_their_tasks() {
        let pool = Pool::new(2);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        let n = AtomicUsize::new(0);
                        pool.run(5, &|_| {
                            n.fetch_add(1, SeqCst);
                        });
                        assert_eq!(n.load(SeqCst), 5);
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let pool = Pool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|t| assert!(t != 5, "task five"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(8, &|_| {
            n.fetch_add(1, SeqCst);
        });
        assert_eq!(n.load(SeqCst), 8);
    }
}
