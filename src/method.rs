//! The training method a pipeline runs (docs/method.md §5–§6): binary RL from PRM votes, on-policy
//! distillation from hints, or both. A leaf module: the configuration, the sample assembly and the
//! trainer's loss all name it, and it names none of them.

use serde::{Deserialize, Serialize};

/// The training method (docs/method.md §5–§6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Binary RL from PRM votes: advantage r.
    Binary,
    /// On-policy distillation from hints: advantage teacher − student (the current policy).
    Opd,
    /// Both: w_rl·r + w_opd·(teacher − student).
    Combined,
}

impl Method {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Binary => "binary",
            Method::Opd => "opd",
            Method::Combined => "combined",
        }
    }
    /// Whether the judge (PRM votes) runs for this method.
    pub fn uses_judge(self) -> bool {
        matches!(self, Method::Binary | Method::Combined)
    }
    /// Whether hint extraction and teacher log-probs run for this method.
    pub fn uses_hints(self) -> bool {
        matches!(self, Method::Opd | Method::Combined)
    }
}
