//! The crate's integration tests, in one binary (one link on a 2-core machine).

mod algebra;
mod common;
mod definition;
mod file;
mod scheduler;
mod wire;
