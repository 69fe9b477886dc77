//! The chaos suite: real processes and real faults — workers killed with SIGKILL and restarted,
//! the S3 server stopped for 30 s, the broker killed with SIGKILL and restarted, all of them in
//! one run, floods of hostile records. Every task must end with a completion or a DLQ record;
//! nothing acknowledged is lost; a task image never becomes two different objects; in
//! exactly-once delivery a `read_committed` reader sees each task's completion once.
//!
//! `make test` runs a fast variant; `make chaos` (`SLUICE_CHAOS=full`) the full one. Each
//! scenario prints a summary table (`--nocapture` shows it). The workers serve the tiny
//! generated model, so the faults land on the pipeline rather than on CPU-bound inference.
//! Scenarios run one at a time: the S3 and broker faults hit the whole stack.
//!
//! - [`kills`]: kill loops, a supervisor's crash loop, records that kill their worker;
//! - [`outages`]: S3 away for 30 s, every fault in one run;
//! - [`hostile`]: floods of hostile records;
//! - [`replicas`]: producer readiness, one idempotency key at two replicas;
//! - [`handoffs`]: SIGTERM handoffs, orphaned partitions;
//! - [`checkpoints`]: step checkpoints across kills, drains and rebalances;
//! - [`scenario`]: what they share.

mod checkpoints;
mod handoffs;
mod hostile;
mod kills;
mod outages;
mod replicas;
mod scenario;
