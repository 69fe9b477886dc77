//! The binary's subcommands besides the worker itself: one run from the command line
//! (`generate`) and copying the model repository from object storage (`sync-models`).

pub mod generate;
pub mod sync_models;
