//! The trainer (METHOD.md §6).
pub mod loss;
