//! The binary's subcommands besides the worker itself: one run from the command line
//! (`generate`), copying the model repository from object storage (`sync-models`) and deleting
//! step checkpoints past an age (`sweep-checkpoints`).

pub mod generate;
pub mod sweep_checkpoints;
pub mod sync_models;
