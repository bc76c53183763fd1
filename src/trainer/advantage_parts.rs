//! [`AdvantageParts`]: a step's advantages split into their reward and teacher parts, and their
//! per-token means ([`AdvantagePartMeans`]).

/// The advantages `A_t` of a step split into the part from the reward and the part from the teacher
/// (docs/method.md §6: `A_t = w_rl·r + w_opd·(teacher_t − student_t)` for combined, `r` for binary,
/// `teacher_t − student_t` for OPD), summed over the masked tokens: which signal moved the policy.
///
/// The reward part of a token is `c·r·s` with `c` = 1 (binary), `w_rl` (combined) or 0 (OPD) and `s`
/// the row's advantage sign (±1, the random-sign control); the teacher part is `A_t` minus it (0 on
/// binary and combined-score-only rows, and with `opd_loss = topk`/`overlap`, whose teacher term is a
/// separate loss, not part of `A_t`).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdvantageParts {
    /// Σ |reward part| over the masked tokens (units of the reward).
    pub reward_abs: f64,
    /// Σ |teacher part| over the masked tokens (nats, times `w_opd` for combined).
    pub teacher_abs: f64,
    /// Masked tokens whose teacher part is > 0 (the teacher rates the token above the policy).
    pub teacher_positive: i64,
    /// Masked tokens whose teacher part is < 0.
    pub teacher_negative: i64,
    /// Masked tokens.
    pub tokens: i64,
}

/// [`AdvantageParts`] per masked token: the means of the two parts and the teacher part's sign
/// fractions (the `train_steps` columns of schema version 3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdvantagePartMeans {
    /// Mean |reward part|.
    pub reward: f64,
    /// Mean |teacher part|.
    pub teacher: f64,
    /// Fraction of tokens whose teacher part is > 0.
    pub teacher_positive: f64,
    /// Fraction of tokens whose teacher part is < 0.
    pub teacher_negative: f64,
}

impl AdvantageParts {
    /// The per-token means; `None` without a masked token.
    pub fn means(&self) -> Option<AdvantagePartMeans> {
        let n = self.tokens as f64;
        (self.tokens > 0).then(|| AdvantagePartMeans {
            reward: self.reward_abs / n,
            teacher: self.teacher_abs / n,
            teacher_positive: self.teacher_positive as f64 / n,
            teacher_negative: self.teacher_negative as f64 / n,
        })
    }

    pub(super) fn add(&mut self, o: &AdvantageParts) {
        self.reward_abs += o.reward_abs;
        self.teacher_abs += o.teacher_abs;
        self.teacher_positive += o.teacher_positive;
        self.teacher_negative += o.teacher_negative;
        self.tokens += o.tokens;
    }
}
