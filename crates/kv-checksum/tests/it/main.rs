//! The crate's integration tests, in one binary (one link on a 2-core machine).

mod algebra;
mod backend;
mod common;
mod definition;
mod file;
mod incremental;
mod scheduler;
mod wire;
