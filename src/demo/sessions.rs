//! The student's sessions as they happened during an online run, and the paper's online metric:
//! **sessions until the student's preferences are met in [`STABLE_RUN`] consecutive sessions**
//! (OpenClaw-RL v2, Table 3: lower is better).
//!
//! A session *meets* the preferences when the agent's **first** answer in it meets every enabled
//! preference ([`super::check`]), so the student thanks it without a correction. A session that needed
//! corrections does not count, even when a later answer satisfied the student: what the metric measures
//! is whether the agent has learned the preferences, not whether it can follow a correction in context.
//! Sessions are counted in the order they **ended** (with concurrent students several are open at once;
//! the order of ending is the order in which the student's verdicts exist).

use serde::{Deserialize, Serialize};

/// Consecutive sessions whose first answer met every preference that make a policy *stable* (3, as in
/// the paper's v2 Table 3).
pub const STABLE_RUN: usize = 3;

/// One homework session of the simulated student during an online run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionOutcome {
    /// Session id (the `X-Session-Id` the student sent).
    pub session: String,
    /// GSM8K problem id (0-based index in the problems file).
    pub problem_id: usize,
    /// 1-based position of this session in the order sessions ended.
    pub ended: usize,
    /// Agent answers in the session (1 to `max_turns`).
    pub turns: u32,
    /// The first answer met every enabled preference (the session *meets* the preferences).
    pub first_answer_satisfied: bool,
    /// The student was satisfied when the session ended (at any turn).
    pub satisfied_at_end: bool,
    /// Policy version that gave the first answer (0: the initial weights; -1: not reported or none).
    pub first_version: i64,
    /// A request of the session failed and ended it (`turns` answers were given before); a failed
    /// session counts as not meeting the preferences unless its first answer did.
    #[serde(default)]
    pub failed: bool,
}

/// Sessions until the preferences are met in `run` consecutive sessions: the 1-based index (in
/// `met`'s order) of the session that completes the first run of `run` consecutive `true`s; `None` when
/// there is no such run (or `run` is 0). `met[i]`: whether session `i + 1` met the preferences.
///
/// Example: `[false, true, true, false, true, true, true]` with `run` 3 gives `Some(7)`.
pub fn sessions_until_stable(met: &[bool], run: usize) -> Option<usize> {
    if run == 0 {
        return None;
    }
    let mut streak = 0;
    for (i, &m) in met.iter().enumerate() {
        streak = if m { streak + 1 } else { 0 };
        if streak == run {
            return Some(i + 1);
        }
    }
    None
}

/// The probability that `n` independent sessions, each meeting the preferences with probability `p`
/// (0–1), contain `run` consecutive met sessions: how often [`sessions_until_stable`] is reached within
/// `n` sessions by chance alone, with no learning. Exact, by dynamic programming over the current streak
/// length. 0 when `run` is 0 or exceeds `n`; `p` is clamped to 0–1.
///
/// Example: `p` = 0.5, `run` = 3: 0.125 for `n` = 3, 0.1875 for `n` = 4.
pub fn chance_of_stable(p: f64, run: usize, n: usize) -> f64 {
    if run == 0 || run > n {
        return 0.0;
    }
    let p = p.clamp(0.0, 1.0);
    // streak[k]: probability of a current streak of k < run met sessions and no run of `run` yet.
    let mut streak = vec![0.0; run];
    streak[0] = 1.0;
    let mut reached = 0.0;
    for _ in 0..n {
        let mut next = vec![0.0; run];
        for (k, &q) in streak.iter().enumerate() {
            next[0] += q * (1.0 - p);
            if k + 1 == run {
                reached += q * p;
            } else {
                next[k + 1] += q * p;
            }
        }
        streak = next;
    }
    reached
}

/// Summary of an online run's sessions (in the order they ended).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionsSummary {
    /// Sessions that ended.
    pub sessions: usize,
    /// [`sessions_until_stable`] with [`STABLE_RUN`] over the sessions' first answers; `None`: not reached.
    pub until_stable: Option<usize>,
    /// Fraction (0–1) of sessions whose first answer met every preference, per quarter of the sessions
    /// in the order they ended: part q holds sessions ⌊q·n/4⌋ to ⌊(q+1)·n/4⌋ − 1 (fewer parts, one
    /// session each, with fewer than 4 sessions).
    pub first_answer_rate_by_quarter: Vec<f64>,
    /// Mean agent answers per session.
    pub mean_turns: f64,
}

impl SessionsSummary {
    /// The summary of `sessions` (any order: they are sorted by [`SessionOutcome::ended`]).
    pub fn of(sessions: &[SessionOutcome]) -> SessionsSummary {
        let mut s: Vec<&SessionOutcome> = sessions.iter().collect();
        s.sort_by_key(|o| o.ended);
        let met: Vec<bool> = s.iter().map(|o| o.first_answer_satisfied).collect();
        let n = met.len();
        let parts = n.min(4);
        let mut quarters = vec![];
        for q in 0..parts {
            let (a, b) = (q * n / parts, if q + 1 == parts { n } else { (q + 1) * n / parts });
            let k = met[a..b].iter().filter(|m| **m).count();
            quarters.push(k as f64 / (b - a).max(1) as f64);
        }
        SessionsSummary {
            sessions: n,
            until_stable: sessions_until_stable(&met, STABLE_RUN),
            first_answer_rate_by_quarter: quarters,
            mean_turns: if n == 0 { 0.0 } else { s.iter().map(|o| f64::from(o.turns)).sum::<f64>() / n as f64 },
        }
    }

    /// One line for reports: "stable after 12 of 40 sessions" or "not stable within 40 sessions".
    pub fn until_stable_text(&self) -> String {
        match self.until_stable {
            Some(k) => format!("preferences met in {STABLE_RUN} consecutive sessions after {k} of {} sessions", self.sessions),
            None => format!("preferences not met in {STABLE_RUN} consecutive sessions within {} sessions", self.sessions),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(ended: usize, first: bool, turns: u32) -> SessionOutcome {
        SessionOutcome { session: format!("s{ended}"), problem_id: ended, ended, turns, first_answer_satisfied: first, satisfied_at_end: true, first_version: 0, failed: false }
    }

    #[test]
    fn the_first_run_of_three_met_sessions_ends_the_count() {
        assert_eq!(sessions_until_stable(&[false, true, true, false, true, true, true], 3), Some(7));
        assert_eq!(sessions_until_stable(&[true, true, true, true], 3), Some(3));
        assert_eq!(sessions_until_stable(&[true, true, false, true, true], 3), None);
        assert_eq!(sessions_until_stable(&[], 3), None);
        assert_eq!(sessions_until_stable(&[true], 1), Some(1));
        assert_eq!(sessions_until_stable(&[true, true, true], 0), None);
    }

    #[test]
    fn the_chance_of_a_stable_run_without_learning_by_hand() {
        assert!((chance_of_stable(0.5, 3, 3) - 0.125).abs() < 1e-12);
        // 3 met at once (1/8) or the first missed and the next three met (1/2 · 1/8).
        assert!((chance_of_stable(0.5, 3, 4) - 0.1875).abs() < 1e-12);
        assert_eq!(chance_of_stable(0.5, 3, 2), 0.0);
        assert_eq!(chance_of_stable(1.0, 3, 10), 1.0);
        assert_eq!(chance_of_stable(0.0, 3, 10), 0.0);
        assert!((chance_of_stable(0.3, 1, 2) - (1.0 - 0.7 * 0.7)).abs() < 1e-12);
        // Monotone in n, and the long-run certainty.
        assert!(chance_of_stable(0.4, 3, 48) > chance_of_stable(0.4, 3, 10));
        assert!(chance_of_stable(0.4, 3, 2000) > 0.999);
    }

    #[test]
    fn the_summary_orders_by_end_and_splits_into_quarters() {
        // Given out of order: ended 1..=8, first answers met at 3, 4, 6, 7, 8.
        let met = [false, false, true, true, false, true, true, true];
        let mut v: Vec<SessionOutcome> = met.iter().enumerate().map(|(i, &m)| outcome(i + 1, m, if m { 1 } else { 3 })).collect();
        v.reverse();
        let s = SessionsSummary::of(&v);
        assert_eq!(s.sessions, 8);
        assert_eq!(s.until_stable, Some(8));
        assert_eq!(s.first_answer_rate_by_quarter, vec![0.0, 1.0, 0.5, 1.0]);
        assert!((s.mean_turns - (5.0 * 1.0 + 3.0 * 3.0) / 8.0).abs() < 1e-12);
        assert_eq!(s.until_stable_text(), "preferences met in 3 consecutive sessions after 8 of 8 sessions");
        // Fewer than four sessions: one entry per session.
        let s = SessionsSummary::of(&v[..2]);
        assert_eq!(s.first_answer_rate_by_quarter, vec![1.0, 1.0]);
        assert_eq!(s.until_stable, None);
        assert_eq!(s.until_stable_text(), "preferences not met in 3 consecutive sessions within 2 sessions");
        // Ten sessions in four parts: 2, 3, 2, 3.
        let ten: Vec<SessionOutcome> = (1..=10).map(|i| outcome(i, i % 2 == 0, 1)).collect();
        assert_eq!(SessionsSummary::of(&ten).first_answer_rate_by_quarter, vec![0.5, 1.0 / 3.0, 0.5, 2.0 / 3.0]);
    }
}
