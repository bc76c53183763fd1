//! Statistics for claims of learning: the 95 % Wilson score interval of a proportion (a personalization
//! score: the fraction of held-out problems whose response meets every preference), the exact
//! McNemar test of paired binary outcomes (the same held-out problems answered by two policy versions),
//! the 95 % Student-t interval of a mean (an arm's score over seeds) and the paired t-test (two arms'
//! per-problem outcomes, averaged over seeds). Distributions come from `statrs`.
//!
//! Sources: E. B. Wilson (1927), "Probable inference, the law of succession, and statistical inference",
//! JASA 22(158); the exact (binomial) McNemar test as in Agresti, *Categorical Data Analysis* (3rd ed.),
//! §11.1: with b pairs that changed 0 → 1 and c that changed 1 → 0, under the null b ~ Binomial(b + c, ½),
//! two-sided p = min(1, 2·P[X ≤ min(b, c)]). The t interval and the paired t-test as in any text, e.g.
//! Wasserman, *All of Statistics*, §10.11: mean x̄, sample sd s (n − 1 in the denominator),
//! x̄ ± t_{0.975, n−1}·s/√n, and for differences d the statistic t = d̄/(s_d/√n) with two-sided
//! p = 2·P[T_{n−1} ≥ |t|].

use serde::{Deserialize, Serialize};
use statrs::distribution::{Binomial, ContinuousCDF, DiscreteCDF, Normal, StudentsT};

use crate::{input_err, Result};

/// A proportion `successes / n` with its two-sided 95 % Wilson score interval (all fractions 0–1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Proportion {
    /// Items that succeeded.
    pub successes: u64,
    /// Items in all.
    pub n: u64,
    /// `successes / n` (0 when `n` is 0).
    pub estimate: f64,
    /// Lower end of the 95 % interval (0 when `n` is 0).
    pub low: f64,
    /// Upper end of the 95 % interval (1 when `n` is 0).
    pub high: f64,
}

/// The normal quantile z with P[Z ≤ z] = 0.975 (1.959964…).
fn z_975() -> f64 {
    Normal::standard().inverse_cdf(0.975)
}

/// `successes / n` with its 95 % Wilson score interval: centre (p̂ + z²/2n)/(1 + z²/n), half-width
/// z·√(p̂(1−p̂)/n + z²/4n²)/(1 + z²/n), z = 1.96. Unlike the normal (Wald) interval it stays inside
/// [0, 1] and is not empty at p̂ = 0 or 1. `n = 0` gives the uninformative [0, 1].
///
/// # Errors
/// [`crate::Error::InvalidInput`] when `successes > n`.
pub fn wilson_95(successes: u64, n: u64) -> Result<Proportion> {
    if successes > n {
        return Err(input_err!("proportion {successes}/{n}: more successes than items"));
    }
    if n == 0 {
        return Ok(Proportion { successes, n, estimate: 0.0, low: 0.0, high: 1.0 });
    }
    let (k, nf, z) = (successes as f64, n as f64, z_975());
    let p = k / nf;
    let z2 = z * z;
    let denom = 1.0 + z2 / nf;
    let centre = (p + z2 / (2.0 * nf)) / denom;
    let half = z * (p * (1.0 - p) / nf + z2 / (4.0 * nf * nf)).sqrt() / denom;
    Ok(Proportion { successes, n, estimate: p, low: (centre - half).max(0.0), high: (centre + half).min(1.0) })
}

/// The exact McNemar test of two paired binary outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct McNemar {
    /// Pairs compared.
    pub n: u64,
    /// Pairs false before and true after.
    pub gained: u64,
    /// Pairs true before and false after.
    pub lost: u64,
    /// Two-sided exact p-value (1 when no pair changed).
    pub p_value: f64,
}

impl McNemar {
    /// Whether the change is significant at level `alpha` (two-sided).
    pub fn significant(&self, alpha: f64) -> bool {
        self.p_value < alpha
    }
}

/// The exact McNemar test of `before[i]` against `after[i]` (the same item, e.g. the same held-out
/// problem, under two policies): see the module docs for the formula.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when the two slices differ in length.
pub fn mcnemar_exact(before: &[bool], after: &[bool]) -> Result<McNemar> {
    if before.len() != after.len() {
        return Err(input_err!("McNemar: {} outcomes before, {} after: they must be the same items", before.len(), after.len()));
    }
    let gained = before.iter().zip(after).filter(|(b, a)| !**b && **a).count() as u64;
    let lost = before.iter().zip(after).filter(|(b, a)| **b && !**a).count() as u64;
    let discordant = gained + lost;
    let p_value = if discordant == 0 {
        1.0
    } else {
        let bin = Binomial::new(0.5, discordant).map_err(|e| input_err!("McNemar: {e}"))?;
        (2.0 * bin.cdf(gained.min(lost))).min(1.0)
    };
    Ok(McNemar { n: before.len() as u64, gained, lost, p_value })
}

/// Holm–Bonferroni adjusted p-values (Holm 1979, "A simple sequentially rejective multiple test
/// procedure", Scand. J. Statist. 6:65–70), in the input order: with the m p-values sorted ascending,
/// p₍ᵢ₎ (i = 1..m) becomes max over j ≤ i of min(1, (m − j + 1)·p₍ⱼ₎). Rejecting where the adjusted value
/// is below α controls the family-wise error rate at α across all m tests. Ties keep their input order.
/// NaN values are treated as 1.
pub fn holm(p: &[f64]) -> Vec<f64> {
    let m = p.len();
    let mut order: Vec<usize> = (0..m).collect();
    let val = |i: usize| if p[i].is_nan() { 1.0 } else { p[i] };
    order.sort_by(|&a, &b| val(a).total_cmp(&val(b)).then(a.cmp(&b)));
    let mut out = vec![1.0; m];
    let mut running: f64 = 0.0;
    for (rank, &i) in order.iter().enumerate() {
        running = running.max(((m - rank) as f64 * val(i)).min(1.0));
        out[i] = running;
    }
    out
}

/// A p-value for text: three decimals, or two significant digits in scientific notation below 0.001
/// (`0.219`, `2.2e-4`); `< 1e-300` for a p-value below that, 0 included (a paired t-test whose
/// differences are all the same non-zero value), never `0.0e0`.
pub fn p_text(p: f64) -> String {
    if p < 1e-300 {
        "< 1e-300".into()
    } else if p < 1e-3 {
        format!("{p:.1e}")
    } else {
        format!("{p:.3}")
    }
}

/// A mean with its two-sided 95 % Student-t interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MeanInterval {
    /// Values.
    pub n: u64,
    /// Their mean.
    pub mean: f64,
    /// Sample standard deviation (n − 1 in the denominator; 0 when n = 1).
    pub sd: f64,
    /// Lower end of the 95 % interval; `None` when n < 2 (no spread to estimate).
    pub low: Option<f64>,
    /// Upper end of the 95 % interval; `None` when n < 2.
    pub high: Option<f64>,
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (mean, var.sqrt())
}

/// The quantile t with P[T_df ≤ t] = 0.975.
fn t_975(df: f64) -> Result<f64> {
    Ok(StudentsT::new(0.0, 1.0, df).map_err(|e| input_err!("Student t with {df} degrees of freedom: {e}"))?.inverse_cdf(0.975))
}

/// The mean of `xs` with its 95 % Student-t interval x̄ ± t_{0.975, n−1}·s/√n (module docs), e.g. an
/// arm's final personalization score over its seeds.
///
/// # Errors
/// [`crate::Error::InvalidInput`] when `xs` is empty or holds a non-finite value.
pub fn mean_t_95(xs: &[f64]) -> Result<MeanInterval> {
    if xs.is_empty() || xs.iter().any(|x| !x.is_finite()) {
        return Err(input_err!("mean interval of {} values: needs at least one, all finite", xs.len()));
    }
    let (mean, sd) = mean_sd(xs);
    let n = xs.len();
    let (low, high) = if n < 2 {
        (None, None)
    } else {
        let half = t_975((n - 1) as f64)? * sd / (n as f64).sqrt();
        (Some(mean - half), Some(mean + half))
    };
    Ok(MeanInterval { n: n as u64, mean, sd, low, high })
}

/// The paired t-test of differences `d` (one per item, e.g. per held-out problem: arm A's outcome minus
/// arm B's, averaged over the seeds they share): the mean difference with its 95 % t interval and the
/// two-sided p-value of "mean difference = 0".
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PairedT {
    /// The mean difference and its interval (`n` = items).
    pub diff: MeanInterval,
    /// Two-sided p-value: 2·P[T_{n−1} ≥ |d̄|/(s/√n)]; with no spread (s = 0) 1 when d̄ = 0 and 0
    /// otherwise; 1 when n < 2.
    pub p_value: f64,
}

/// The paired t-test of `diffs` (module docs; see [`PairedT`]).
///
/// # Errors
/// [`crate::Error::InvalidInput`] when `diffs` is empty or holds a non-finite value.
pub fn paired_t(diffs: &[f64]) -> Result<PairedT> {
    let diff = mean_t_95(diffs)?;
    let p_value = if diff.n < 2 {
        1.0
    } else if diff.sd == 0.0 {
        if diff.mean == 0.0 {
            1.0
        } else {
            0.0
        }
    } else {
        let t = diff.mean / (diff.sd / (diff.n as f64).sqrt());
        let dist = StudentsT::new(0.0, 1.0, (diff.n - 1) as f64).map_err(|e| input_err!("paired t: {e}"))?;
        // The survival function, not 1 − cdf: 1 − cdf rounds to 0 once the cdf is within 1.1e-16 of 1.
        (2.0 * dist.sf(t.abs())).min(1.0)
    };
    Ok(PairedT { diff, p_value })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holm_by_hand() {
        // Sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → max(0.06, 0.04) = 0.06.
        let got = holm(&[0.01, 0.04, 0.03, 0.005]);
        let want = [0.03, 0.06, 0.06, 0.02];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-15, "{got:?}");
        }
        // Capped at 1; one test is unadjusted; NaN counts as 1; empty stays empty.
        assert_eq!(holm(&[0.4, 0.6]), vec![0.8, 0.8]);
        assert_eq!(holm(&[0.02]), vec![0.02]);
        assert_eq!(holm(&[f64::NAN, 0.01]), vec![1.0, 0.02]);
        assert!(holm(&[]).is_empty());
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn wilson_matches_hand_values() {
        // 3/12: p = 0.25, z = 1.959964; centre = (0.25 + 0.160065)/1.320131 = 0.310625,
        // half = 1.959964·sqrt(0.015625 + 0.006669)/1.320131 = 0.221697 → [0.0889, 0.5323].
        let w = wilson_95(3, 12).unwrap();
        assert_eq!((w.successes, w.n), (3, 12));
        assert!(close(w.estimate, 0.25, 1e-12));
        assert!(close(w.low, 0.088_93, 1e-4) && close(w.high, 0.532_32, 1e-4), "{w:?}");
        // 24/48 is symmetric about 0.5: [0.3635, 0.6365].
        let w = wilson_95(24, 48).unwrap();
        assert!(close(w.low + w.high, 1.0, 1e-12) && close(w.low, 0.363_5, 1e-3), "{w:?}");
        // The ends stay inside [0, 1] and are not empty.
        let w = wilson_95(0, 12).unwrap();
        assert_eq!(w.low, 0.0);
        assert!(close(w.high, 0.242_5, 1e-3), "{w:?}");
        let w = wilson_95(12, 12).unwrap();
        assert!(close(w.low, 0.757_5, 1e-3) && w.high == 1.0, "{w:?}");
        assert_eq!(wilson_95(0, 0).unwrap(), Proportion { successes: 0, n: 0, estimate: 0.0, low: 0.0, high: 1.0 });
        assert!(wilson_95(5, 4).is_err());
    }

    #[test]
    fn mcnemar_matches_the_binomial_by_hand() {
        // 3 gained, 0 lost: p = 2·(1/2)^3 = 0.25.
        let before = [false, false, false, true, true, false];
        let after = [true, true, true, true, true, false];
        let m = mcnemar_exact(&before, &after).unwrap();
        assert_eq!((m.n, m.gained, m.lost), (6, 3, 0));
        assert!(close(m.p_value, 0.25, 1e-12), "{m:?}");
        // 8 gained, 1 lost: p = 2·(C(9,0) + C(9,1))/2^9 = 2·10/512 = 0.0390625 — significant at 0.05.
        let mut b = vec![false; 8];
        let mut a = vec![true; 8];
        b.push(true);
        a.push(false);
        let m = mcnemar_exact(&b, &a).unwrap();
        assert_eq!((m.gained, m.lost), (8, 1));
        assert!(close(m.p_value, 0.039_062_5, 1e-12) && m.significant(0.05), "{m:?}");
        // Balanced changes: p capped at 1; no change at all: p = 1.
        assert_eq!(mcnemar_exact(&[true, false], &[false, true]).unwrap().p_value, 1.0);
        assert_eq!(mcnemar_exact(&[true, false], &[true, false]).unwrap().p_value, 1.0);
        assert!(mcnemar_exact(&[true], &[true, false]).is_err());
    }

    #[test]
    fn t_interval_and_paired_t_match_hand_values() {
        // 1..5: mean 3, s = √2.5 = 1.581139, s/√5 = 0.707107, t_{0.975,4} = 2.776445 → [1.036757, 4.963243].
        let m = mean_t_95(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        assert_eq!(m.n, 5);
        assert!(close(m.mean, 3.0, 1e-12) && close(m.sd, 1.581_139, 1e-6), "{m:?}");
        assert!(close(m.low.unwrap(), 1.036_757, 1e-5) && close(m.high.unwrap(), 4.963_243, 1e-5), "{m:?}");
        // Three seeds 0.4, 0.5, 0.6: s/√3 = 0.057735, t_{0.975,2} = 4.302653 → 0.5 ± 0.248414.
        let m = mean_t_95(&[0.4, 0.5, 0.6]).unwrap();
        assert!(close(m.low.unwrap(), 0.251_586, 1e-5) && close(m.high.unwrap(), 0.748_414, 1e-5), "{m:?}");
        // One value: no interval.
        let m = mean_t_95(&[0.7]).unwrap();
        assert_eq!((m.n, m.mean, m.sd, m.low, m.high), (1, 0.7, 0.0, None, None));
        assert!(mean_t_95(&[]).is_err() && mean_t_95(&[1.0, f64::NAN]).is_err());
        // Paired t on 1..5: t = 3/0.707107 = 4.242641, df 4; p = I_{4/(4+18)}(2, 1/2) in closed form:
        // (4/3 − (2√(9/11) − (2/3)(9/11)^1.5))/(4/3) = 0.013235.
        let p = paired_t(&[1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        assert!(close(p.p_value, 0.013_235, 1e-5), "{p:?}");
        // A mean difference exactly at the 95 % quantile has p = 0.05: values 1 + k·o with offsets
        // o = (−1, −½, 0, ½, 1) have mean 1 and s/√5 = k·√(2.5/4)/√5 = k·0.353553; k = 1/(t_{0.975,4}·0.353553)
        // puts t = 1/(s/√5) at t_{0.975,4} = 2.776445.
        let k = 1.0 / (2.776_445_105 * (0.625f64).sqrt() / 5f64.sqrt());
        let xs: Vec<f64> = [-1.0, -0.5, 0.0, 0.5, 1.0].iter().map(|o| 1.0 + o * k).collect();
        let p = paired_t(&xs).unwrap();
        assert!(close(p.p_value, 0.05, 1e-6), "{p:?}");
        assert!(close(p.diff.low.unwrap(), 0.0, 1e-6), "the interval's end touches 0: {p:?}");
        // No spread: p = 1 at 0, 0 elsewhere; one item: p = 1.
        assert_eq!(paired_t(&[0.0, 0.0, 0.0]).unwrap().p_value, 1.0);
        assert_eq!(paired_t(&[0.5, 0.5]).unwrap().p_value, 0.0);
        assert_eq!(paired_t(&[0.5]).unwrap().p_value, 1.0);
    }

    #[test]
    fn a_paired_t_far_in_the_tail_keeps_its_p_value_and_its_text() {
        // 1 − d, 1, 1 + d: mean 1, s = d, t = 1/(d/√3) = √3/d, df 2. For df 2 the two-sided p has the
        // closed form 1 − t/√(t² + 2) = 1/t² − 3/(2t⁴) + …, so t = 1e9 gives p = 1.0e-18, which
        // 2·(1 − cdf) rounded to 0.
        let d = 3f64.sqrt() / 1e9;
        let p = paired_t(&[1.0 - d, 1.0, 1.0 + d]).unwrap().p_value;
        assert!((p / 1e-18 - 1.0).abs() < 1e-4, "{p:e}");
        assert_eq!(p_text(p), "1.0e-18");
        // Text: three decimals, scientific below 0.001, and a floor instead of `0.0e0`.
        assert_eq!(p_text(0.219_4), "0.219");
        assert_eq!(p_text(2.24e-4), "2.2e-4");
        assert_eq!(p_text(0.0), "< 1e-300");
        assert_eq!(p_text(paired_t(&[0.5, 0.5]).unwrap().p_value), "< 1e-300");
    }
}
