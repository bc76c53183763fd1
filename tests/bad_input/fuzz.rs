//! Bounded fuzzing.
