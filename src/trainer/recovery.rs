//! Bad-batch handling: a step whose loss or gradient norm is not finite, or on which libtorch fails,
//! never stops training. The weights and AdamW stay as they were, each sample is probed alone to find
//! the offenders, the step is retried once without them, and otherwise skipped
//! ([`SkippedStep`]; see [`Trainer::train_step`]).

use super::batch::{pack_samples, Dropped};
use super::accumulate::accumulate_gradients;
use super::policy::Policy;
use super::outcome::{SkipReason, SkippedStep, StepFailure, StepOutcome};
use super::step::Trainer;
use crate::schema::Sample;
use crate::{Error, Result};

/// How one sample fared when evaluated alone (forward, loss, backward, gradient norm; no step).
enum Probe {
    /// Finite loss and gradient norm.
    Good,
    /// Left out by the packer (the step itself drops and reports it).
    Dropped,
    /// Non-finite loss or gradient, or a libtorch error: (why, the numbers).
    Offender(SkipReason, String),
}

impl<P: Policy> Trainer<P> {
    /// After `try_step(samples)` failed with `reason` (`err`; weights and AdamW untouched): finds the
    /// offending samples by probing each alone, retries the step once without them, and otherwise skips
    /// the step. See [`Trainer::train_step`].
    pub(super) fn recover(&mut self, samples: &[Sample], reason: SkipReason, err: &Error) -> Result<StepOutcome> {
        self.opt.zero_grad()?;
        let mut detail = format!("step {}: {err}", self.step + 1);
        tracing::warn!(step = self.step + 1, reason = reason.as_str(), error = %err, samples = samples.len(), "training step failed; evaluating its samples one at a time");
        let mut offenders: Vec<usize> = vec![];
        let mut dropped_alone: Vec<usize> = vec![];
        for (i, s) in samples.iter().enumerate() {
            match self.probe(s)? {
                Probe::Good => {}
                Probe::Dropped => dropped_alone.push(i),
                Probe::Offender(r, d) => {
                    detail.push_str(&format!("; sample {} alone: {} ({d})", s.sample_id, r.as_str()));
                    offenders.push(i);
                }
            }
        }
        let rest: Vec<usize> = (0..samples.len()).filter(|i| !offenders.contains(i)).collect();
        let kept_rest = rest.iter().filter(|i| !dropped_alone.contains(i)).count();
        if !offenders.is_empty() && kept_rest > 0 {
            let subset: Vec<Sample> = rest.iter().map(|&i| samples[i].clone()).collect();
            let adam_steps = self.opt.steps();
            match self.try_step(&subset) {
                Ok(mut o) => {
                    for d in &mut o.dropped {
                        d.index = rest[d.index];
                    }
                    let step = self.step;
                    let picked: Vec<Sample> = offenders.iter().map(|&i| samples[i].clone()).collect();
                    self.record_skipped(&picked, &[], &(0..picked.len()).collect::<Vec<_>>(), reason, step);
                    tracing::warn!(step, reason = reason.as_str(), skipped = offenders.len(), trained = kept_rest, "step retried without the offending samples");
                    o.skipped = Some(SkippedStep { reason, detail, samples: offenders });
                    return Ok(o);
                }
                Err(StepFailure::Skip(_, e)) if self.opt.steps() == adam_steps => {
                    self.opt.zero_grad()?;
                    detail.push_str(&format!("; the retry without them failed too: {e}"));
                }
                Err(StepFailure::Skip(_, e)) => {
                    return Err(Error::Internal(format!("step {}: the AdamW update failed part-way: {e}", self.step + 1)));
                }
                Err(StepFailure::Fatal(e)) => return Err(e),
            }
        } else if offenders.is_empty() {
            detail.push_str("; no sample fails alone, so the whole batch is skipped");
        }
        // Skip the whole step: the packer's drops stay drops (with their reasons), the rest is skipped.
        let mut dropped: Vec<Dropped> = vec![];
        for &i in &dropped_alone {
            let packed = pack_samples(std::slice::from_ref(&samples[i]), &self.pack_options())?;
            dropped.extend(packed.dropped.into_iter().map(|d| Dropped { index: i, ..d }));
        }
        let skipped: Vec<usize> = (0..samples.len()).filter(|i| !dropped_alone.contains(i)).collect();
        let step = self.step;
        self.record_skipped(samples, &dropped, &skipped, reason, step);
        tracing::warn!(step = step + 1, reason = reason.as_str(), skipped = skipped.len(), dropped = dropped.len(), detail = %detail, "training step skipped; weights unchanged");
        Ok(StepOutcome { train_step: None, metrics: None, dropped, checkpoint: None, skipped: Some(SkippedStep { reason, detail, samples: skipped }) })
    }

    /// Forward, loss and backward of `sample` alone, then the gradient norm; no optimizer step, and the
    /// gradients are zeroed again. Used to find the offenders of a failed step.
    fn probe(&mut self, sample: &Sample) -> Result<Probe> {
        self.opt.zero_grad()?;
        let result = (|| -> Result<Probe> {
            let acc = accumulate_gradients(&self.policy, self.reference.as_deref(), self.method, &self.cfg, self.version, std::slice::from_ref(sample))?;
            let Some(m) = acc.metrics else { return Ok(Probe::Dropped) };
            if !m.loss.is_finite() {
                return Ok(Probe::Offender(SkipReason::NonFiniteLoss, format!("loss {}, pg {}, kl {}, entropy {}, top-K {}", m.loss, m.pg_loss, m.kl, m.entropy, m.topk_kl)));
            }
            let norm = self.opt.grad_norm()?;
            if !norm.is_finite() {
                return Ok(Probe::Offender(SkipReason::NonFiniteGrad, format!("loss {}, gradient norm {norm}", m.loss)));
            }
            Ok(Probe::Good)
        })();
        self.opt.zero_grad()?;
        match result {
            Err(Error::Torch(e)) => Ok(Probe::Offender(SkipReason::TorchError, e.to_string())),
            other => other,
        }
    }

    /// Lineage entries of every sample of `samples`, none trained: those in `dropped` with the packer's
    /// reason, those at the indices `skipped` with `reason`.
    fn record_skipped(&mut self, samples: &[Sample], dropped: &[Dropped], skipped: &[usize], reason: SkipReason, step: i64) {
        let start = self.pending_lineage.len();
        self.record_lineage(samples, dropped, step);
        for (k, l) in self.pending_lineage[start..].iter_mut().enumerate() {
            if skipped.contains(&k) {
                l.trained = false;
                l.drop_reason = Some(reason.as_str().to_string());
            }
        }
    }
}
