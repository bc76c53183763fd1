//! Spike alarms on the training loop's health figures ([`AlarmSettings`]): each step's gradient norm
//! (before clipping) and mean |rollout − current| log-prob gap against the running median of the
//! steps before it. An alarm is a warning log line and `trainer_alarms_total{kind}`; it changes
//! nothing in training.

use std::collections::VecDeque;

use super::config::{AlarmSettings, ALARM_MIN_HISTORY};

/// Floor under the gradient norm's running median: a spike must exceed `factor × max(median, 0.1)`.
pub const GRAD_NORM_FLOOR: f64 = 0.1;
/// Floor under the log-prob gap's running median (nats per token): the first steps of a run score the
/// weights that sampled, so their gap is ~0 and any later gap would otherwise be a spike.
pub const LOGPROB_GAP_FLOOR: f64 = 0.01;
/// No alarm until this many earlier steps are in the window ([`ALARM_MIN_HISTORY`]).
pub const MIN_HISTORY: usize = ALARM_MIN_HISTORY;

/// Which figure spiked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlarmKind {
    /// The global gradient norm before clipping.
    GradNorm,
    /// The step's mean |rollout − current| log-prob over its trained tokens (nats).
    LogprobGap,
}

impl AlarmKind {
    /// Label value of `trainer_alarms_total{kind}`: `grad_norm` or `logprob_gap`.
    pub fn as_str(self) -> &'static str {
        match self {
            AlarmKind::GradNorm => "grad_norm",
            AlarmKind::LogprobGap => "logprob_gap",
        }
    }

    fn floor(self) -> f64 {
        match self {
            AlarmKind::GradNorm => GRAD_NORM_FLOOR,
            AlarmKind::LogprobGap => LOGPROB_GAP_FLOOR,
        }
    }
}

/// A spike: the value, the running median it was compared with and the threshold it crossed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Alarm {
    /// Which figure.
    pub kind: AlarmKind,
    /// This step's value.
    pub value: f64,
    /// Median of the previous steps in the window.
    pub median: f64,
    /// `factor × max(median, floor)`.
    pub threshold: f64,
}

/// The running windows of both figures.
#[derive(Debug, Clone)]
pub struct Alarms {
    settings: AlarmSettings,
    grad_norm: VecDeque<f64>,
    gap: VecDeque<f64>,
}

impl Alarms {
    /// Empty windows.
    pub fn new(settings: AlarmSettings) -> Alarms {
        Alarms { settings, grad_norm: VecDeque::new(), gap: VecDeque::new() }
    }

    /// Adds one step's figures and returns the alarms they raise (compared with the steps before them;
    /// a non-finite value is not added and raises nothing: the step that had it was skipped).
    pub fn observe(&mut self, grad_norm: f64, logprob_gap: f64) -> Vec<Alarm> {
        let window = self.settings.window;
        let factor = self.settings.factor;
        let mut out = vec![];
        for (kind, value, hist) in [(AlarmKind::GradNorm, grad_norm, &mut self.grad_norm), (AlarmKind::LogprobGap, logprob_gap, &mut self.gap)] {
            if !value.is_finite() {
                continue;
            }
            if hist.len() >= MIN_HISTORY {
                let median = median(hist);
                let threshold = factor * median.max(kind.floor());
                if value > threshold {
                    out.push(Alarm { kind, value, median, threshold });
                }
            }
            hist.push_back(value);
            while hist.len() > window {
                hist.pop_front();
            }
        }
        out
    }
}

/// Median of a non-empty window (mean of the two middle values for an even count).
fn median(values: &VecDeque<f64>) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spike_against_the_running_median_alarms_and_noise_does_not() {
        let mut a = Alarms::new(AlarmSettings { window: 4, factor: 10.0 });
        // Grad norms 3, 8, 5, 4: no alarm before 4 are in the window.
        for g in [3.0, 8.0, 5.0, 4.0] {
            assert!(a.observe(g, 0.02).is_empty());
        }
        // Median of [3, 8, 5, 4] = 4.5 → threshold 45: 40 is not a spike, 2243 is. The gap's median
        // 0.02 → threshold 0.2 (floor 0.01 below it): 233 is a spike.
        assert!(a.observe(40.0, 0.05).is_empty());
        // Window now [8, 5, 4, 40]: median 6.5, threshold 65.
        let got = a.observe(2243.0, 233.0);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!((got[0].kind, got[0].value, got[0].median, got[0].threshold), (AlarmKind::GradNorm, 2243.0, 6.5, 65.0));
        // Gap window [0.02, 0.02, 0.02, 0.05]: median 0.02, threshold 0.2.
        assert_eq!(got[1].kind, AlarmKind::LogprobGap);
        assert!((got[1].median - 0.02).abs() < 1e-12 && (got[1].threshold - 0.2).abs() < 1e-12, "{:?}", got[1]);
    }

    #[test]
    fn the_floor_keeps_a_near_zero_start_quiet() {
        let mut a = Alarms::new(AlarmSettings::default());
        for _ in 0..5 {
            assert!(a.observe(0.5, 1e-6).is_empty());
        }
        // Gap 0.04 against a median of 1e-6: below 10 × the 0.01 floor, no alarm; 0.2 is one.
        assert!(a.observe(0.5, 0.04).is_empty());
        let got = a.observe(0.5, 0.2);
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].kind == AlarmKind::LogprobGap && (got[0].threshold - 0.1).abs() < 1e-12, "{got:?}");
        // A non-finite value is neither an alarm nor history.
        assert!(a.observe(f64::NAN, f64::INFINITY).is_empty());
    }
}
