//! Hand-computed checks of the docs/method.md §6 loss math (f64 tensors on CPU).

use proptest::prelude::*;
use tch::{Kind, Tensor};

use super::*;

fn t1(v: &[f64]) -> Tensor {
    Tensor::from_slice(v)
}

fn t2(rows: &[&[f64]]) -> Tensor {
    let b = rows.len() as i64;
    let t = rows.first().map_or(0, |r| r.len()) as i64;
    let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_slice(&flat).view([b, t])
}

fn t3(rows: &[&[&[f64]]]) -> Tensor {
    let b = rows.len() as i64;
    let t = rows[0].len() as i64;
    let k = rows[0][0].len() as i64;
    let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().flat_map(|c| c.iter().copied())).collect();
    Tensor::from_slice(&flat).view([b, t, k])
}

fn v2(t: &Tensor) -> Vec<Vec<f64>> {
    Vec::<Vec<f64>>::try_from(&t.to_kind(Kind::Double)).unwrap()
}

fn v1(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(&t.to_kind(Kind::Double)).unwrap()
}

fn assert_close(got: f64, want: f64, tol: f64) {
    assert!((got - want).abs() <= tol, "got {got}, want {want} (tol {tol})");
}

fn assert_all_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ: {got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= tol, "got {got:?}, want {want:?}");
    }
}

fn ln(x: f64) -> f64 {
    x.ln()
}

/// Loss inputs with only the policy, rollout, reward, mask and types given (no teacher, weights, signs,
/// reference, entropy or top-K).
fn plain_inputs<'a>(new: &'a Tensor, old: &'a Tensor, reward: &'a Tensor, mask: &'a Tensor, types: &'a [SampleType]) -> LossInputs<'a> {
    LossInputs {
        new_logprobs: new,
        old_logprobs: old,
        teacher_logprobs: None,
        reward,
        mask,
        sample_types: types,
        sample_weights: None,
        advantage_signs: None,
        ref_logprobs: None,
        entropy: None,
        topk: None,
        sample_tokens: None,
        num_samples: None,
    }
}

// ---------- advantages ----------

#[test]
fn binary_advantage_is_the_reward_on_masked_tokens() {
    let cfg = LossConfig::new(Method::Binary);
    let r = t1(&[1.0, -1.0]);
    let old = t2(&[&[-0.3, -0.7, -1.1], &[-0.2, -0.4, 0.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    let a = advantages(&cfg, &r, &old, None, &[SampleType::Binary, SampleType::Binary], &mask).unwrap();
    // A_t = r on every masked token, 0 on the padded third token of row 2.
    assert_eq!(v2(&a), vec![vec![1.0, 1.0, 1.0], vec![-1.0, -1.0, 0.0]]);
}

#[test]
fn opd_advantage_is_teacher_minus_student() {
    let cfg = LossConfig::new(Method::Opd);
    let old = t2(&[&[-1.0, -0.25, -2.0]]);
    let teacher = t2(&[&[-0.5, -1.0, -2.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0]]);
    let a = advantages(&cfg, &t1(&[0.0]), &old, Some(&teacher), &[SampleType::Opd], &mask).unwrap();
    // −0.5 − (−1) = 0.5; −1 − (−0.25) = −0.75; −2 − (−2) = 0.
    assert_all_close(&v2(&a)[0], &[0.5, -0.75, 0.0], 1e-12);
    // OPD needs the teacher.
    assert!(advantages(&cfg, &t1(&[0.0]), &old, None, &[SampleType::Opd], &mask).is_err());
    // With the top-K loss only, the PPO advantage of OPD is 0.
    let topk = LossConfig { opd_loss: OpdLoss::Topk, ..cfg };
    let a = advantages(&topk, &t1(&[0.0]), &old, Some(&teacher), &[SampleType::Opd], &mask).unwrap();
    assert_eq!(v2(&a)[0], vec![0.0, 0.0, 0.0]);
}

#[test]
fn combined_advantage_weights_reward_and_teacher_term() {
    let old = t2(&[&[-1.0, -0.25], &[-1.0, -0.25], &[-1.0, -0.25]]);
    let teacher = t2(&[&[-0.5, -1.0], &[-0.5, -1.0], &[-3.0, -3.0]]);
    let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0], &[1.0, 1.0]]);
    let r = t1(&[1.0, 0.0, -1.0]);
    let types = [SampleType::CombinedBoth, SampleType::CombinedHintOnly, SampleType::CombinedScoreOnly];
    let cfg = LossConfig::new(Method::Combined);
    let a = advantages(&cfg, &r, &old, Some(&teacher), &types, &mask).unwrap();
    // Row 1: 1·1 + 1·(0.5) = 1.5; 1 + 1·(−0.75) = 0.25.
    // Row 2: r = 0: 0.5, then masked → 0.
    // Row 3: score-only: the teacher term is 0 by construction, A = r = −1 on both tokens.
    let a = v2(&a);
    assert_all_close(&a[0], &[1.5, 0.25], 1e-12);
    assert_all_close(&a[1], &[0.5, 0.0], 1e-12);
    assert_all_close(&a[2], &[-1.0, -1.0], 1e-12);
    // w_rl = 2, w_opd = 0.5: 2 + 0.5·0.5 = 2.25; 2 + 0.5·(−0.75) = 1.625.
    let w = LossConfig { w_rl: 2.0, w_opd: 0.5, ..cfg };
    let a = advantages(&w, &r, &old, Some(&teacher), &types, &mask).unwrap();
    assert_all_close(&v2(&a)[0], &[2.25, 1.625], 1e-12);
    // opd_loss = topk: only w_rl·r remains: 2·1 = 2 on row 1.
    let tk = LossConfig { opd_loss: OpdLoss::Topk, ..w };
    let a = advantages(&tk, &r, &old, Some(&teacher), &types, &mask).unwrap();
    assert_all_close(&v2(&a)[0], &[2.0, 2.0], 1e-12);
}

#[test]
fn advantages_are_constants() {
    let old = t2(&[&[-1.0, -0.5]]).set_requires_grad(true);
    let teacher = t2(&[&[-0.5, -1.0]]).set_requires_grad(true);
    let a = advantages(&LossConfig::new(Method::Combined), &t1(&[1.0]), &old, Some(&teacher), &[SampleType::CombinedBoth], &t2(&[&[1.0, 1.0]])).unwrap();
    assert!(!a.requires_grad());
}

#[test]
fn advantage_shape_errors_name_the_shapes() {
    let cfg = LossConfig::new(Method::Binary);
    let e = advantages(&cfg, &t1(&[1.0, 1.0, 1.0]), &t2(&[&[0.0, 0.0]]), None, &[SampleType::Binary], &t2(&[&[1.0, 1.0]])).unwrap_err();
    assert!(e.to_string().contains("[3]") && e.to_string().contains("[1]"), "{e}");
}

proptest! {
    /// docs/method.md §6: with teacher = student and r = 0, the combined advantage is exactly 0 (any weights,
    /// any sample type, any mask).
    #[test]
    fn combined_advantage_is_zero_when_teacher_equals_student_and_no_reward(
        old in proptest::collection::vec(-30.0f64..0.0, 1..24),
        w_rl in -3.0f64..3.0,
        w_opd in -3.0f64..3.0,
        mask_bits in proptest::collection::vec(any::<bool>(), 24),
        type_idx in 0usize..3,
    ) {
        let t = old.len() as i64;
        let old_t = Tensor::from_slice(&old).view([1, t]);
        let mask: Vec<f64> = mask_bits[..old.len()].iter().map(|&b| if b { 1.0 } else { 0.0 }).collect();
        let mask = Tensor::from_slice(&mask).view([1, t]);
        let ty = [SampleType::CombinedBoth, SampleType::CombinedHintOnly, SampleType::CombinedScoreOnly][type_idx];
        let cfg = LossConfig { w_rl, w_opd, ..LossConfig::new(Method::Combined) };
        let a = advantages(&cfg, &t1(&[0.0]), &old_t, Some(&old_t.copy()), &[ty], &mask).unwrap();
        for x in v2(&a)[0].iter() {
            prop_assert_eq!(*x, 0.0);
        }
    }
}

/// docs/method.md §6 (the reference's target): the OPD term of the whole loss is `teacher − student` with
/// `student` = `new` (the current policy), never the rollout log-probs in `old`. The rollout log-probs
/// only move the PPO ratio; a policy whose log-probs were lowered by δ gets advantages δ higher.
#[test]
fn opd_term_of_the_loss_uses_the_current_policy_not_the_rollout() {
    let teacher = t2(&[&[-0.5, -1.0, -2.0], &[-0.7, -0.9, 0.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    let reward = t1(&[0.0, -1.0]);
    let types = [SampleType::CombinedHintOnly, SampleType::CombinedScoreOnly];
    let cfg = LossConfig::new(Method::Combined);
    let run = |new: &Tensor, old: &Tensor| {
        let inp = LossInputs { teacher_logprobs: Some(&teacher), ..plain_inputs(new, old, &reward, &mask, &types) };
        v2(&compute_loss(&cfg, &inp).unwrap().advantages)
    };
    let new = t2(&[&[-1.0, -0.25, -2.0], &[-0.7, -0.9, 0.0]]);
    // Rollout log-probs far from the policy: they must not enter the advantage.
    let rollout = t2(&[&[-3.0, -3.0, -3.0], &[-5.0, -0.1, 0.0]]);
    let a = run(&new, &rollout);
    // Row 1 (hint only, r = 0): −0.5 − (−1) = 0.5; −1 − (−0.25) = −0.75; −2 − (−2) = 0.
    assert_all_close(&a[0], &[0.5, -0.75, 0.0], 1e-12);
    // Row 2 (score only): the teacher term is exactly 0 whatever new and old are: A = r = −1.
    assert_eq!(a[1], vec![-1.0, -1.0, 0.0]);
    // The same policy with other rollout log-probs: identical advantages.
    assert_eq!(run(&new, &new.copy()), a);
    // A step lowered the policy's log-probs by δ = (0.3, 0.05, 1.0): the OPD advantage rises by δ.
    let lowered = new.f_sub(&t2(&[&[0.3, 0.05, 1.0], &[0.2, 0.2, 0.0]])).unwrap();
    let b = run(&lowered, &rollout);
    assert_all_close(&b[0], &[0.8, -0.7, 1.0], 1e-12);
    assert_eq!(b[1], vec![-1.0, -1.0, 0.0]);
}

// ---------- PPO ----------

#[test]
fn ppo_clip_in_both_directions_of_advantage_and_ratio() {
    // Six tokens, ε = 0.2, ε_high = 0.28 (ratio clipped to [0.8, 1.28]):
    //  1. A=+1, log r=+0.5 → r=1.648721: −r·A=−1.648721, −1.28·A=−1.28 → max −1.28, clipped, grad 0.
    //  2. A=+1, log r=−0.5 → r=0.606531: −0.606531 vs −0.8 → max −0.606531, unclipped, grad −A·r = −0.606531.
    //  3. A=−1, log r=+0.5: 1.648721 vs 1.28 → 1.648721, unclipped, grad −A·r = 1.648721.
    //  4. A=−1, log r=−0.5: 0.606531 vs 0.8 → 0.8, clipped, grad 0.
    //  5. A=+2, log r=+0.1 → r=1.105171 inside the range: −2.210342 both, unclipped, grad −2.210342.
    //  6. A=0: both terms 0, not clipped (0 > 0 is false), grad 0.
    let old = t2(&[&[-1.0; 6]]);
    let new = t2(&[&[-0.5, -1.5, -0.5, -1.5, -0.9, -1.0]]).set_requires_grad(true);
    let adv = t2(&[&[1.0, 1.0, -1.0, -1.0, 2.0, 0.0]]);
    let p = ppo_clipped_loss(&new, &old, &adv, 0.2, 0.28).unwrap();
    let e05 = 0.5f64.exp();
    let em05 = (-0.5f64).exp();
    let e01 = 0.1f64.exp();
    assert_all_close(&v2(&p.loss)[0], &[-1.28, -em05, e05, 0.8, -2.0 * e01, 0.0], 1e-12);
    assert_eq!(v2(&p.clipped)[0], vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0]);
    p.loss.sum(Kind::Double).backward();
    assert_all_close(&v2(&new.grad())[0], &[0.0, -em05, e05, 0.0, -2.0 * e01, 0.0], 1e-12);
}

#[test]
fn clip_fraction_and_ppo_kl_over_masked_tokens() {
    // Binary advantage is r per row; two rows give both signs: row 1 r=+1, row 2 r=−1.
    let old2 = t2(&[&[-1.0, -1.0, -1.0], &[-1.0, -1.0, -1.0]]);
    let new2 = t2(&[&[-0.5, -1.5, -0.9], &[-0.5, -1.5, -1.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 1.0]]);
    let types = [SampleType::Binary, SampleType::Binary];
    let reward = t1(&[1.0, -1.0]);
    let inp = plain_inputs(&new2, &old2, &reward, &mask, &types);
    let out = compute_loss(&LossConfig::new(Method::Binary), &inp).unwrap();
    // Row 1 (A=+1): log r = 0.5 clipped, −0.5 unclipped, 0.1 unclipped.
    // Row 2 (A=−1): log r = 0.5 unclipped, −0.5 clipped, 0 unclipped. → 2 of 6.
    assert_close(out.metrics.clip_fraction, 2.0 / 6.0, 1e-12);
    // ppo_kl = mean(old − new) = mean(−0.5, 0.5, −0.1, −0.5, 0.5, 0) = −0.1/6.
    assert_close(out.metrics.ppo_kl, -0.1 / 6.0, 1e-12);
    // pg per row: row 1: (−1.28 − e^−0.5 − e^0.1)/3; row 2: (e^0.5 + 0.8 + 1)/3; the step's loss is the
    // mean over its 2 samples.
    let row1 = (-1.28 - (-0.5f64).exp() - 0.1f64.exp()) / 3.0;
    let row2 = (0.5f64.exp() + 0.8 + 1.0) / 3.0;
    assert_close(out.metrics.pg_loss, (row1 + row2) / 2.0, 1e-12);
    assert_close(out.metrics.loss, (row1 + row2) / 2.0, 1e-12);
    assert_all_close(&v1(&out.per_sample.pg_loss), &[row1, row2], 1e-12);
    // Over a step of 8 samples (these 2 are one micro-batch of it): the sum of sample means over 8.
    let out8 = compute_loss(&LossConfig::new(Method::Binary), &LossInputs { num_samples: Some(8.0), ..inp }).unwrap();
    assert_close(out8.metrics.pg_loss, (row1 + row2) / 8.0, 1e-12);
    assert_all_close(&v1(&out.per_sample.clip_fraction), &[1.0 / 3.0, 1.0 / 3.0], 1e-12);
    assert_eq!(out.metrics.tokens, 6);
    assert_eq!(out.metrics.samples, 2);
    // Masking the clipped token of row 2 out: 1 clipped of 5 masked tokens.
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 1.0]]);
    let out = compute_loss(&LossConfig::new(Method::Binary), &LossInputs { mask: &mask, ..inp }).unwrap();
    assert_close(out.metrics.clip_fraction, 1.0 / 5.0, 1e-12);
    // A random-sign control (TrainerConfig::advantage_sign): signs [−1, −1] swap the two rows' advantages
    // (+1 ↔ −1), so row 1 now scores like row 2 did with its own ratios: A=−1 on log r (0.5, −0.5, 0.1):
    // unclipped, clipped (0.8), unclipped → (e^0.5 + 0.8 + e^0.1)/3; row 2 with A=+1 on (0.5, −0.5, 0):
    // clipped (1.28), unclipped, unclipped → (−1.28 − e^−0.5 − 1)/3.
    let signs = t1(&[-1.0, -1.0]);
    let flipped = compute_loss(&LossConfig::new(Method::Binary), &LossInputs { advantage_signs: Some(&signs), ..inp }).unwrap();
    let row1 = (0.5f64.exp() + 0.8 + 0.1f64.exp()) / 3.0;
    let row2 = (-1.28 - (-0.5f64).exp() - 1.0) / 3.0;
    assert_all_close(&v1(&flipped.per_sample.pg_loss), &[row1, row2], 1e-12);
    assert_all_close(&v1(&flipped.per_sample.advantage), &[-1.0, 1.0], 1e-12);
    let ones = t1(&[1.0, 1.0]);
    let same = compute_loss(&LossConfig::new(Method::Binary), &LossInputs { advantage_signs: Some(&ones), ..inp }).unwrap();
    assert_close(same.metrics.pg_loss, out8.metrics.pg_loss * 4.0, 1e-12);
    let bad = t1(&[1.0]);
    assert!(compute_loss(&LossConfig::new(Method::Binary), &LossInputs { advantage_signs: Some(&bad), ..inp }).unwrap_err().to_string().contains("advantage signs"));
}

// ---------- k3 KL ----------

#[test]
fn k3_kl_values_and_clamp() {
    // d = ref − new: 0 → e^0 − 1 − 0 = 0; 1 → e − 2 = 0.718281828; −1 → e^−1 − 1 + 1 = 0.367879441;
    // 3 → e^3 − 4 = 16.0855 → clamped to 10; −20 → e^−20 + 19 = 19.000000002 → clamped to 10.
    let new = t2(&[&[-1.0, -1.0, -1.0, -4.0, -1.0]]);
    let reference = t2(&[&[-1.0, 0.0, -2.0, -1.0, -21.0]]);
    let kl = k3_kl(&new, &reference).unwrap();
    assert_all_close(&v2(&kl)[0], &[0.0, std::f64::consts::E - 2.0, (-1.0f64).exp(), 10.0, 10.0], 1e-12);
}

#[test]
fn k3_kl_gradient_is_zero_when_clamped() {
    // d/dnew of e^(ref−new) − 1 − (ref−new) = 1 − e^(ref−new): d=1 → 1 − e = −1.718281828; clamped → 0.
    let new = t2(&[&[-1.0, -4.0]]).set_requires_grad(true);
    let reference = t2(&[&[0.0, -1.0]]);
    k3_kl(&new, &reference).unwrap().sum(Kind::Double).backward();
    assert_all_close(&v2(&new.grad())[0], &[1.0 - std::f64::consts::E, 0.0], 1e-12);
}

#[test]
fn kl_term_enters_the_loss_with_its_coefficient() {
    // One binary row, r = 0 (pg = 0), one token with ref − new = 1: kl = e − 2 = 0.718281828.
    let new = t2(&[&[-1.0]]);
    let reference = t2(&[&[0.0]]);
    let mask = t2(&[&[1.0]]);
    let reward = t1(&[0.0]);
    let types = [SampleType::Binary];
    let inp = LossInputs {
        new_logprobs: &new,
        old_logprobs: &new,
        teacher_logprobs: None,
        reward: &reward,
        mask: &mask,
        sample_types: &types,
        sample_weights: None,
        advantage_signs: None,
        ref_logprobs: Some(&reference),
        entropy: None,
        topk: None,
        sample_tokens: None,
        num_samples: None,
    };
    let cfg = LossConfig { kl_coef: 0.5, ..LossConfig::new(Method::Binary) };
    let out = compute_loss(&cfg, &inp).unwrap();
    let kl = std::f64::consts::E - 2.0;
    assert_close(out.metrics.kl, kl, 1e-12);
    assert_close(out.metrics.loss, 0.5 * kl, 1e-12);
    // Weight 0: reported, not in the loss.
    let out = compute_loss(&LossConfig::new(Method::Binary), &inp).unwrap();
    assert_close(out.metrics.kl, kl, 1e-12);
    assert_close(out.metrics.loss, 0.0, 1e-12);
    // kl_coef ≠ 0 without a reference is an error.
    assert!(compute_loss(&cfg, &LossInputs { ref_logprobs: None, ..inp }).is_err());
}

// ---------- entropy ----------

#[test]
fn entropy_of_known_distributions() {
    // Uniform over 4: ln 4 = 1.386294361; (0.5, 0.25, 0.25, 0): −(0.5 ln 0.5 + 2·0.25 ln 0.25) = 1.039720771
    // (0·ln 0 would be NaN with a true −inf; use a tiny probability instead: 1e−300·ln(1e−300) ≈ 0).
    let full = t3(&[&[&[ln(0.25), ln(0.25), ln(0.25), ln(0.25)], &[ln(0.5), ln(0.25), ln(0.25 - 1e-300), ln(1e-300)]]]);
    let h = entropy(&full).unwrap();
    assert_all_close(&v2(&h)[0], &[4f64.ln(), 1.5 * 2f64.ln()], 1e-12);
}

// ---------- top-K reverse KL ----------

#[test]
fn topk_reverse_kl_k1_with_tail_bin() {
    // K = 1: student p = 0.5 → tail 0.5; teacher p = 0.25 → tail 0.75.
    // KL = 0.5·ln(0.5/0.25) + 0.5·ln(0.5/0.75) = 0.5·ln(4/3) = 0.143841036.
    let s = t3(&[&[&[ln(0.5)]]]);
    let t = t3(&[&[&[ln(0.25)]]]);
    let tail = add_tail_bin(&t).unwrap();
    assert_all_close(&Vec::<Vec<Vec<f64>>>::try_from(&tail).unwrap()[0][0], &[ln(0.25), ln(0.75)], 1e-12);
    let kl = topk_reverse_kl(&s, &t).unwrap();
    assert_close(v2(&kl)[0][0], 0.5 * (4.0f64 / 3.0).ln(), 1e-12);
}

#[test]
fn topk_reverse_kl_k3_with_tail_bin() {
    // Student top-3 (at the teacher's ids) 0.4, 0.2, 0.1 → tail 0.3; teacher 0.5, 0.1, 0.2 → tail 0.2.
    // KL = 0.4 ln(0.4/0.5) + 0.2 ln(0.2/0.1) + 0.1 ln(0.1/0.2) + 0.3 ln(0.3/0.2)
    //    = −0.089257421 + 0.138629436 − 0.069314718 + 0.121639532 = 0.101696829.
    let s = t3(&[&[&[ln(0.4), ln(0.2), ln(0.1)]]]);
    let t = t3(&[&[&[ln(0.5), ln(0.1), ln(0.2)]]]);
    let want = 0.4 * ln(0.4 / 0.5) + 0.2 * ln(2.0) + 0.1 * ln(0.5) + 0.3 * ln(1.5);
    assert_close(want, 0.101696829, 1e-9);
    assert_close(v2(&topk_reverse_kl(&s, &t).unwrap())[0][0], want, 1e-12);
    // Identical distributions: 0.
    assert_close(v2(&topk_reverse_kl(&s, &s.copy()).unwrap())[0][0], 0.0, 1e-12);
}

#[test]
fn topk_tail_clamp_keeps_a_full_mass_teacher_finite() {
    // Teacher top-2 0.6 + 0.4 = 1: logsumexp = 0 → clamped to −1e−7, tail = ln(1 − e^−1e−7) = ln(9.9999995e−8)
    // = −16.118095700. Student 0.5, 0.3 → tail 0.2.
    // KL = 0.5 ln(0.5/0.6) + 0.3 ln(0.3/0.4) + 0.2 (ln 0.2 + 16.1180957) = −0.091160778 − 0.086304622 + 2.901731558
    //    = 2.724266158.
    let s = t3(&[&[&[ln(0.5), ln(0.3)]]]);
    let t = t3(&[&[&[ln(0.6), ln(0.4)]]]);
    let tail_t = (-(-1e-7f64).exp_m1()).ln();
    assert_close(tail_t, -16.1180957, 1e-6);
    let want = 0.5 * ln(0.5 / 0.6) + 0.3 * ln(0.75) + 0.2 * (ln(0.2) - tail_t);
    assert_close(want, 2.724266158, 1e-8);
    assert_close(v2(&topk_reverse_kl(&s, &t).unwrap())[0][0], want, 1e-9);
}

#[test]
fn topk_reverse_kl_gradient_flows_to_the_student_only() {
    let logits = Tensor::from_slice(&[0.3f64, -0.2, 1.0, 0.0]).set_requires_grad(true);
    let full = logits.log_softmax(-1, Kind::Double).view([1, 1, 4]);
    let ids = Tensor::from_slice(&[2i64, 0]).view([1, 1, 2]);
    let s = full.gather(2, &ids, false);
    let t = t3(&[&[&[ln(0.5), ln(0.2)]]]).set_requires_grad(true);
    topk_reverse_kl(&s, &t).unwrap().sum(Kind::Double).backward();
    let g = Vec::<f64>::try_from(&logits.grad()).unwrap();
    assert!(g.iter().all(|x| x.is_finite()) && g.iter().any(|x| x.abs() > 1e-6), "{g:?}");
    assert!(!t.grad().defined() || v2(&t.grad().view([1, 2])).iter().flatten().all(|x| *x == 0.0));
}

// ---------- aggregation ----------

#[test]
fn mean_of_sample_means_with_uneven_lengths_and_masks() {
    // Row 1: tokens 1, 2, 3 (4 is padding) → mean 2. Row 2: 10, 20 → 15. Row 3: no masked token → 0.
    // Row 4: mask with a hole: 1, 3, 4 (2 excluded by the loss mask) → 8/3.
    // Mean over the 4 samples = (2 + 15 + 0 + 8/3) / 4 = 4.916666667.
    let x = t2(&[&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0, 0.0, 0.0], &[5.0, 0.0, 0.0, 0.0], &[1.0, 2.0, 3.0, 4.0]]);
    let m = t2(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 0.0, 0.0], &[0.0, 0.0, 0.0, 0.0], &[1.0, 0.0, 1.0, 1.0]]);
    assert_all_close(&v1(&sample_means(&x, &m).unwrap()), &[2.0, 15.0, 0.0, 8.0 / 3.0], 1e-12);
    let agg = |w: Option<&Tensor>, n: f64| mean_of_sample_means(&x, &m, w, None, n).unwrap().double_value(&[]);
    assert_close(agg(None, 4.0), (2.0 + 15.0 + 8.0 / 3.0) / 4.0, 1e-12);
    // Weights 1, 0.5, 1, 0: (2 + 7.5 + 0 + 0) / 4 = 2.375.
    let w = t1(&[1.0, 0.5, 1.0, 0.0]);
    assert_close(agg(Some(&w), 4.0), 2.375, 1e-12);
    // These 4 as one micro-batch of a 16-sample step: divided by 16.
    assert_close(agg(None, 16.0), (2.0 + 15.0 + 8.0 / 3.0) / 16.0, 1e-12);
    // This is not the token mean: (1+2+3+10+20+1+3+4)/8 = 5.5.
    assert!((agg(None, 4.0) - 5.5).abs() > 0.5);
    assert!(mean_of_sample_means(&x, &m, None, None, 0.0).is_err());
}

#[test]
fn chunks_of_positions_add_up_to_the_whole_with_the_samples_token_counts() {
    // Split the positions of the batch above into [0, 1) and [1, 4): each chunk aggregated with the
    // whole samples' token counts n_b = (3, 2, 0, 3); the two chunk losses sum to the whole loss.
    let x = t2(&[&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0, 0.0, 0.0], &[5.0, 0.0, 0.0, 0.0], &[1.0, 2.0, 3.0, 4.0]]);
    let m = t2(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 0.0, 0.0], &[0.0, 0.0, 0.0, 0.0], &[1.0, 0.0, 1.0, 1.0]]);
    let n = t1(&[3.0, 2.0, 0.0, 3.0]);
    let part = |s: i64, l: i64| mean_of_sample_means(&x.narrow(1, s, l), &m.narrow(1, s, l), None, Some(&n), 4.0).unwrap().double_value(&[]);
    // [0,1): (1/3 + 10/2 + 0 + 1/3)/4 = 1.416666667; [1,4): (5/3 + 20/2 + 0 + 7/3)/4 = 3.5.
    assert_close(part(0, 1), (1.0 / 3.0 + 5.0 + 1.0 / 3.0) / 4.0, 1e-12);
    assert_close(part(1, 3), (5.0 / 3.0 + 10.0 + 7.0 / 3.0) / 4.0, 1e-12);
    assert_close(part(0, 1) + part(1, 3), (2.0 + 15.0 + 8.0 / 3.0) / 4.0, 1e-12);
}

#[test]
fn masked_out_non_finite_values_do_not_leak() {
    let x = t2(&[&[1.0, f64::NAN, f64::INFINITY]]);
    let m = t2(&[&[1.0, 0.0, 0.0]]);
    assert_close(mean_of_sample_means(&x, &m, None, None, 1.0).unwrap().double_value(&[]), 1.0, 0.0);
}

#[test]
fn mean_of_sample_means_gradient_is_mask_over_length_over_samples() {
    // d/dx of (1/N) Σ_b mean_b with N = 2: 1/6 on row 1's three tokens, 1/4 on row 2's two, 0 on padding.
    let x = t2(&[&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]]).set_requires_grad(true);
    let m = t2(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 1.0]]);
    mean_of_sample_means(&x, &m, None, None, 2.0).unwrap().backward();
    let g = v2(&x.grad());
    assert_all_close(&g[0], &[1.0 / 6.0; 3], 1e-12);
    assert_all_close(&g[1], &[0.25, 0.0, 0.25], 1e-12);
}

#[test]
fn log_ratio_is_clamped_before_exp() {
    // new − old = 30 → clamped to 20: ratio e^20 = 485165195.4, finite; −1000 → e^−20.
    // With A = −1 the unclipped term −ratio·A = e^20 is the max; its gradient is 0 (clamp binds).
    let new = t2(&[&[-1.0, -1001.0]]).set_requires_grad(true);
    let old = t2(&[&[-31.0, -1.0]]);
    let adv = t2(&[&[-1.0, 1.0]]);
    let p = ppo_clipped_loss(&new, &old, &adv, 0.2, 0.28).unwrap();
    assert_all_close(&v2(&p.ratio)[0], &[20f64.exp(), (-20f64).exp()], 1e-3);
    assert!(v2(&p.loss)[0].iter().all(|x| x.is_finite()));
    p.loss.sum(Kind::Double).backward();
    assert_all_close(&v2(&new.grad())[0], &[0.0, 0.0], 0.0);
}

// ---------- the whole loss ----------

#[test]
fn combined_loss_components_and_identity() {
    // Row 1 CombinedBoth r=1, two tokens; row 2 CombinedScoreOnly r=−1, one token (second is padding).
    // new = old everywhere (ratio 1, nothing clipped), so L_t = −A_t.
    // Row 1: teacher − old = (0.5, −0.25) → A = (1.5, 0.75) → pg mean = −1.125.
    // Row 2: A = −1 → pg = 1. pg_loss = −0.125.
    // Entropy given as 2 on row 1's tokens and 1 on row 2's: sum of means = 2 + 1 = 3; entropy_coef 0.1
    // → sum −0.125 − 0.3 = −0.425; the step's loss is that over its 2 samples: pg −0.0625, entropy 1.5,
    // loss −0.2125.
    let old = t2(&[&[-1.0, -0.5], &[-0.7, 0.0]]);
    let new = old.copy().set_requires_grad(true);
    let teacher = t2(&[&[-0.5, -0.75], &[-0.7, 0.0]]);
    let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0]]);
    let reward = t1(&[1.0, -1.0]);
    let ent = t2(&[&[2.0, 2.0], &[1.0, 99.0]]);
    let types = [SampleType::CombinedBoth, SampleType::CombinedScoreOnly];
    let inp = LossInputs {
        new_logprobs: &new,
        old_logprobs: &old,
        teacher_logprobs: Some(&teacher),
        reward: &reward,
        mask: &mask,
        sample_types: &types,
        sample_weights: None,
        advantage_signs: None,
        ref_logprobs: None,
        entropy: Some(&ent),
        topk: None,
        sample_tokens: None,
        num_samples: None,
    };
    let cfg = LossConfig { entropy_coef: 0.1, ..LossConfig::new(Method::Combined) };
    let out = compute_loss(&cfg, &inp).unwrap();
    let m = &out.metrics;
    assert_close(m.pg_loss, -0.0625, 1e-12);
    assert_close(m.entropy, 1.5, 1e-12);
    assert_close(m.loss, -0.2125, 1e-12);
    assert_close(m.loss, m.pg_loss + cfg.kl_coef * m.kl - cfg.entropy_coef * m.entropy, 1e-12);
    assert_close(m.clip_fraction, 0.0, 0.0);
    assert_close(m.advantage_by_type["combined-both"], 1.125, 1e-12);
    assert_close(m.advantage_by_type["combined-score-only"], -1.0, 1e-12);
    assert_eq!(m.tokens, 3);
    assert_all_close(&v1(&out.per_sample.loss), &[-1.125 - 0.2, 1.0 - 0.1], 1e-12);
    // Staleness weights 1 and 0.5: pg = (−1.125 + 0.5)/2 = −0.3125; entropy (2 + 0.5)/2 = 1.25 →
    // loss −0.3125 − 0.125 = −0.4375.
    let w = t1(&[1.0, 0.5]);
    let out = compute_loss(&cfg, &LossInputs { sample_weights: Some(&w), ..inp }).unwrap();
    assert_close(out.metrics.pg_loss, -0.3125, 1e-12);
    assert_close(out.metrics.loss, -0.4375, 1e-12);
    // Gradient wrt new at ratio 1 is −A·w/(len·N), N = 2: row 1: −1.5/4, −0.75/4; row 2: 0.5·1/2.
    out.loss.backward();
    let g = v2(&new.grad());
    assert_all_close(&g[0], &[-0.375, -0.1875], 1e-12);
    assert_all_close(&g[1], &[0.25, 0.0], 1e-12);
}

#[test]
fn opd_topk_loss_replaces_or_joins_the_ppo_term() {
    // One OPD row, one token: old = new = −1, teacher = −0.5 → A = 0.5, pg = −0.5 (ratio 1).
    // Top-K (K=1): student 0.5, teacher 0.25 → topk_kl = 0.5·ln(4/3) = 0.143841036.
    let old = t2(&[&[-1.0]]);
    let teacher = t2(&[&[-0.5]]);
    let mask = t2(&[&[1.0]]);
    let reward = t1(&[0.0]);
    let s = t3(&[&[&[ln(0.5)]]]);
    let tt = t3(&[&[&[ln(0.25)]]]);
    let types = [SampleType::Opd];
    let inp = LossInputs {
        new_logprobs: &old,
        old_logprobs: &old,
        teacher_logprobs: Some(&teacher),
        reward: &reward,
        mask: &mask,
        sample_types: &types,
        sample_weights: None,
        advantage_signs: None,
        ref_logprobs: None,
        entropy: None,
        topk: Some(TopkInputs { student: &s, teacher: &tt, mask: &mask, subset: None }),
        sample_tokens: None,
        num_samples: None,
    };
    let topk = 0.5 * (4.0f64 / 3.0).ln();
    let base = LossConfig::new(Method::Opd);
    // ppo: loss = pg only; top-K reported.
    let out = compute_loss(&base, &inp).unwrap();
    assert_close(out.metrics.loss, -0.5, 1e-12);
    assert_close(out.metrics.topk_kl, topk, 1e-12);
    // topk: A = 0 → pg = 0; loss = 2·topk with topk_coef 2.
    let out = compute_loss(&LossConfig { opd_loss: OpdLoss::Topk, topk_coef: 2.0, ..base }, &inp).unwrap();
    assert_close(out.metrics.pg_loss, 0.0, 0.0);
    assert_close(out.metrics.loss, 2.0 * topk, 1e-12);
    // both: −0.5 + topk.
    let out = compute_loss(&LossConfig { opd_loss: OpdLoss::Both, ..base }, &inp).unwrap();
    assert_close(out.metrics.loss, -0.5 + topk, 1e-12);
    // topk without top-K inputs is an error.
    assert!(compute_loss(&LossConfig { opd_loss: OpdLoss::Topk, ..base }, &LossInputs { topk: None, ..inp }).is_err());
    // The binary method never uses the top-K term.
    assert!(!LossConfig { opd_loss: OpdLoss::Both, ..LossConfig::new(Method::Binary) }.uses_topk());
}

#[test]
fn overlap_term_by_hand_with_subsets_and_gradient() {
    // One position, two ids: old = new = [ln 0.5, ln 0.25], teacher = [ln 0.6, ln 0.5], c = 0.5.
    // w = softmax(old) = [2/3, 1/3]; teacher − old = [ln 1.2, ln 2] → clipped [0.1823216, 0.5];
    // A = [0.1215477, 0.1666667]; ratio 1, so the term is −ΣA = −0.2882144 and ∂/∂new = −A.
    let new = t3(&[&[&[ln(0.5), ln(0.25)]]]).set_requires_grad(true);
    let teacher = t3(&[&[&[ln(0.6), ln(0.5)]]]);
    let a = [(2.0 / 3.0) * 1.2f64.ln(), 0.5 / 3.0];
    let term = overlap_opd_loss(&new, &teacher, None, 0.5, 0.2, 0.28).unwrap();
    assert_eq!(term.size(), vec![1, 1]);
    assert_close(v2(&term)[0][0], -(a[0] + a[1]), 1e-12);
    term.sum(Kind::Double).backward();
    assert_all_close(&v1(&new.grad().view([-1])), &[-a[0], -a[1]], 1e-12);

    // Subset = the first id only: w = [1, 0], A = [ln 1.2, 0].
    let new = t3(&[&[&[ln(0.5), ln(0.25)]]]).set_requires_grad(true);
    let only_first = t3(&[&[&[1.0, 0.0]]]);
    let term = overlap_opd_loss(&new, &teacher, Some(&only_first), 0.5, 0.2, 0.28).unwrap();
    assert_close(v2(&term)[0][0], -1.2f64.ln(), 1e-12);
    term.sum(Kind::Double).backward();
    assert_all_close(&v1(&new.grad().view([-1])), &[-1.2f64.ln(), 0.0], 1e-12);

    // An empty subset contributes exactly 0 (no NaN), even with a non-finite teacher value there.
    let bad_teacher = t3(&[&[&[f64::NAN, f64::NEG_INFINITY]]]);
    let term = overlap_opd_loss(&new, &bad_teacher, Some(&t3(&[&[&[0.0, 0.0]]])), 0.5, 0.2, 0.28).unwrap();
    assert_eq!(v2(&term), vec![vec![0.0]]);
    // The clip c binds symmetrically: teacher far below old gives −c per id before weighting.
    let low = t3(&[&[&[ln(0.5) - 5.0, ln(0.25) - 5.0]]]);
    let term = overlap_opd_loss(&new.detach(), &low, None, 1.0, 0.2, 0.28).unwrap();
    assert_close(v2(&term)[0][0], 1.0, 1e-12);
    assert!(overlap_opd_loss(&new, &t2(&[&[0.0]]), None, 1.0, 0.2, 0.28).is_err(), "shapes must match");
}

#[test]
fn overlap_loss_enters_with_w_opd_and_keeps_only_the_reward_in_ppo() {
    // A combined row, r = 1, one token: old = new = −1 (PPO term −w_rl·r = −1 at ratio 1), teacher
    // log-prob of the sampled token −0.5 (ignored by the overlap loss's PPO advantage). The overlap
    // term over ids [ln 0.5, ln 0.25] with teacher [ln 0.6, ln 0.5], c = 0.5 is −0.2882144 (above).
    let old = t2(&[&[-1.0]]);
    let teacher = t2(&[&[-0.5]]);
    let mask = t2(&[&[1.0]]);
    let reward = t1(&[1.0]);
    let s = t3(&[&[&[ln(0.5), ln(0.25)]]]);
    let tt = t3(&[&[&[ln(0.6), ln(0.5)]]]);
    let types = [SampleType::CombinedBoth];
    let inp = LossInputs {
        new_logprobs: &old,
        old_logprobs: &old,
        teacher_logprobs: Some(&teacher),
        reward: &reward,
        mask: &mask,
        sample_types: &types,
        sample_weights: None,
        advantage_signs: None,
        ref_logprobs: None,
        entropy: None,
        topk: Some(TopkInputs { student: &s, teacher: &tt, mask: &mask, subset: None }),
        sample_tokens: None,
        num_samples: None,
    };
    let term = -((2.0 / 3.0) * 1.2f64.ln() + 0.5 / 3.0);
    let cfg = LossConfig { opd_loss: OpdLoss::Overlap, w_opd: 2.0, overlap_clip: 0.5, ..LossConfig::new(Method::Combined) };
    assert!(cfg.uses_overlap() && !cfg.uses_topk() && !cfg.teacher_in_advantage());
    let out = compute_loss(&cfg, &inp).unwrap();
    assert_close(out.metrics.pg_loss, -1.0, 1e-12);
    assert_close(out.metrics.topk_kl, term, 1e-12);
    assert_close(out.metrics.loss, -1.0 + 2.0 * term, 1e-12);
    assert_eq!(v2(&out.advantages), vec![vec![1.0]], "the PPO advantage is w_rl·r only");
    assert!(compute_loss(&cfg, &LossInputs { topk: None, ..inp }).is_err(), "overlap needs the candidates' data");
    // A batch with no hinted row (only score-only rows) has no teacher term: 0, not an error.
    let so = [SampleType::CombinedScoreOnly];
    let out = compute_loss(&cfg, &LossInputs { topk: None, sample_types: &so, ..inp }).unwrap();
    assert_close(out.metrics.topk_kl, 0.0, 0.0);
    assert_close(out.metrics.loss, -1.0, 1e-12);
    assert!(!LossConfig { opd_loss: OpdLoss::Overlap, ..LossConfig::new(Method::Binary) }.uses_overlap());
}
