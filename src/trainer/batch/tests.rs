//! Batch assembly: alignment on a hand-made batch, drops with reasons.

use tch::{Device, Tensor};

use super::*;
use crate::trainer::test_util::sample;

fn opts(method: Method) -> PackOptions {
    PackOptions { method, vocab_size: 50, pad_id: 2, current_version: 0, device: Device::Cpu, config: TrainerConfig { quarantine: crate::trainer::QuarantineSettings::off(), ..TrainerConfig::default() } }
}

fn i2(t: &Tensor) -> Vec<Vec<i64>> {
    Vec::<Vec<i64>>::try_from(t).unwrap()
}
fn f2(t: &Tensor) -> Vec<Vec<f32>> {
    Vec::<Vec<f32>>::try_from(t).unwrap()
}

#[test]
fn packs_a_hand_made_batch_with_aligned_series() {
    // Row a: prompt [5, 6, 7], response [8, 9], loss mask [1, 0], rollout [−0.1, −0.2], teacher [−0.3, −0.4],
    //        top-2 ids [[8, 1], [9, 3]] log-probs [[−0.5, −1.5], [−0.6, −1.6]], r = 1.
    // Row b: prompt [10], response [11, 12, 13], rollout [−1, −2, −3], teacher [−4, −5, −6], no top-K, r = 0.
    // L = max(3+2, 1+3) = 5, T = 3, K = 2.
    let mut a = sample("a", SampleType::CombinedBoth, &[5, 6, 7], &[8, 9], &[-0.1, -0.2], 1.0);
    a.loss_mask = vec![1, 0];
    a.teacher_logprobs = Some(vec![-0.3, -0.4]);
    a.topk_ids = Some(vec![vec![8, 1], vec![9, 3]]);
    a.topk_logprobs = Some(vec![vec![-0.5, -1.5], vec![-0.6, -1.6]]);
    let mut b = sample("b", SampleType::CombinedHintOnly, &[10], &[11, 12, 13], &[-1.0, -2.0, -3.0], 0.0);
    b.teacher_logprobs = Some(vec![-4.0, -5.0, -6.0]);
    let packed = pack_samples(&[a, b], &opts(Method::Combined)).unwrap();
    assert!(packed.dropped.is_empty(), "{:?}", packed.dropped);
    let p = packed.batch.unwrap();
    assert_eq!(p.input_ids.size(), vec![2, 5]);
    // Right padding with pad id 2.
    assert_eq!(i2(&p.input_ids), vec![vec![5, 6, 7, 8, 9], vec![10, 11, 12, 13, 2]]);
    assert_eq!(i2(&p.response_ids), vec![vec![8, 9, 0], vec![11, 12, 13]]);
    // Response token t is predicted at P − 1 + t: row a 2, 3; row b 0, 1, 2.
    assert_eq!(i2(&p.predict_positions), vec![vec![2, 3, 0], vec![0, 1, 2]]);
    // input_ids[b, predict_positions[b, t] + 1] == response_ids[b, t] on real tokens.
    let ids = i2(&p.input_ids);
    for (row, (pos, resp)) in i2(&p.predict_positions).iter().zip(i2(&p.response_ids)).enumerate() {
        for t in 0..p.response_lens[row] {
            assert_eq!(ids[row][pos[t] as usize + 1], resp[t]);
        }
    }
    assert_eq!(f2(&p.response_mask), vec![vec![1.0, 1.0, 0.0], vec![1.0, 1.0, 1.0]]);
    assert_eq!(f2(&p.loss_mask), vec![vec![1.0, 0.0, 0.0], vec![1.0, 1.0, 1.0]]);
    // Row a's second token has loss mask 0: its values become 0 (never trained).
    assert_eq!(f2(&p.old_logprobs), vec![vec![-0.1, 0.0, 0.0], vec![-1.0, -2.0, -3.0]]);
    assert_eq!(f2(p.teacher_logprobs.as_ref().unwrap()), vec![vec![-0.3, 0.0, 0.0], vec![-4.0, -5.0, -6.0]]);
    assert_eq!(Vec::<f32>::try_from(&p.reward).unwrap(), vec![1.0, 0.0]);
    assert_eq!(Vec::<f32>::try_from(&p.sample_weight).unwrap(), vec![1.0, 1.0]);
    let tk_ids = Vec::<Vec<Vec<i64>>>::try_from(p.topk_ids.as_ref().unwrap()).unwrap();
    assert_eq!(tk_ids, vec![vec![vec![8, 1], vec![9, 3], vec![0, 0]], vec![vec![0, 0]; 3]]);
    let tk_lps = Vec::<Vec<Vec<f32>>>::try_from(p.topk_logprobs.as_ref().unwrap()).unwrap();
    assert_eq!(tk_lps[0], vec![vec![-0.5, -1.5], vec![0.0, 0.0], vec![0.0, 0.0]]);
    // Top-K positions: row a's trained tokens only; row b has no top-K lists.
    assert_eq!(f2(p.topk_mask.as_ref().unwrap()), vec![vec![1.0, 0.0, 0.0], vec![0.0, 0.0, 0.0]]);
    assert_eq!(p.sample_types, vec![SampleType::CombinedBoth, SampleType::CombinedHintOnly]);
    assert_eq!((p.prompt_lens.clone(), p.response_lens.clone(), p.max_response_len(), p.batch_size()), (vec![3, 1], vec![2, 3], 3, 2));
}

#[test]
fn drops_bad_rows_with_reasons_and_keeps_the_rest() {
    let good = sample("good", SampleType::Binary, &[1], &[2], &[-0.5], 1.0);
    let empty_prompt = sample("ep", SampleType::Binary, &[], &[2], &[-0.5], 1.0);
    let empty_resp = sample("er", SampleType::Binary, &[1], &[], &[], 1.0);
    let short = sample("short", SampleType::Binary, &[1], &[2, 3], &[-0.5], 1.0);
    let mut nan = sample("nan", SampleType::Binary, &[1], &[2, 3], &[-0.5, f32::NAN], 1.0);
    let mut nan_masked = sample("nan_masked", SampleType::Binary, &[1], &[2, 3], &[-0.5, f32::NAN], 1.0);
    nan_masked.loss_mask = vec![1, 0];
    let vocab = sample("vocab", SampleType::Binary, &[1], &[50], &[-0.5], 1.0);
    let wrong = sample("wrong", SampleType::Opd, &[1], &[2], &[-0.5], 0.0);
    nan.loss_mask = vec![1, 1];
    let packed = pack_samples(&[good, empty_prompt, empty_resp, short, nan, nan_masked, vocab, wrong], &opts(Method::Binary)).unwrap();
    let reasons: Vec<(&str, DropReason)> = packed.dropped.iter().map(|d| (d.sample_id.as_str(), d.reason)).collect();
    assert_eq!(
        reasons,
        vec![
            ("ep", DropReason::EmptyPrompt),
            ("er", DropReason::EmptyResponse),
            ("short", DropReason::LengthMismatch),
            ("nan", DropReason::NonFinite),
            ("vocab", DropReason::TokenOutOfVocab),
            ("wrong", DropReason::WrongMethod),
        ]
    );
    assert!(packed.dropped[2].detail.contains("1 values for 2"), "{}", packed.dropped[2].detail);
    assert!(packed.dropped[3].detail.contains("position 1"), "{}", packed.dropped[3].detail);
    assert!(packed.dropped[4].detail.contains("50") && packed.dropped[4].detail.contains("0..50"), "{}", packed.dropped[4].detail);
    let b = packed.batch.unwrap();
    assert_eq!(b.sample_ids, vec!["good".to_string(), "nan_masked".to_string()]);
    assert_eq!(b.source_index, vec![0, 5]);
    assert!(b.teacher_logprobs.is_none() && b.topk_ids.is_none());
    // NaN at a loss-mask-0 position is replaced by 0.
    assert_eq!(f2(&b.old_logprobs)[1], vec![-0.5, 0.0]);
}

#[test]
fn teacher_topk_and_staleness_rules() {
    let mut cfg = TrainerConfig { opd_loss: OpdLoss::Topk, max_staleness: Some(1), ..opts(Method::Opd).config };
    let mut o = PackOptions { current_version: 3, config: cfg.clone(), ..opts(Method::Opd) };
    let mut with_topk = sample("tk", SampleType::Opd, &[1], &[2], &[-0.5], 0.0);
    with_topk.teacher_logprobs = Some(vec![-0.4]);
    with_topk.topk_ids = Some(vec![vec![2, 3, 4]]);
    with_topk.topk_logprobs = Some(vec![vec![-0.4, -1.0, -2.0]]);
    with_topk.policy_version = Some(2);
    let mut no_teacher = with_topk.clone();
    no_teacher.sample_id = "nt".into();
    no_teacher.teacher_logprobs = None;
    let mut no_topk = with_topk.clone();
    no_topk.sample_id = "nk".into();
    no_topk.topk_ids = None;
    no_topk.topk_logprobs = None;
    let mut narrow = with_topk.clone();
    narrow.sample_id = "narrow".into();
    narrow.topk_ids = Some(vec![vec![2, 3]]);
    narrow.topk_logprobs = Some(vec![vec![-0.4, -1.0]]);
    let mut stale = with_topk.clone();
    stale.sample_id = "stale".into();
    stale.policy_version = Some(1);
    let all = [with_topk.clone(), no_teacher, no_topk, narrow.clone(), stale.clone()];
    let packed = pack_samples(&all, &o).unwrap();
    let reasons: Vec<(&str, DropReason)> = packed.dropped.iter().map(|d| (d.sample_id.as_str(), d.reason)).collect();
    assert_eq!(
        reasons,
        vec![("nt", DropReason::MissingTeacher), ("nk", DropReason::MissingTopk), ("narrow", DropReason::TopkWidth), ("stale", DropReason::Stale)]
    );
    assert!(packed.dropped[3].detail.contains("2 versions behind 3"), "{}", packed.dropped[3].detail);
    assert_eq!(packed.batch.unwrap().topk_ids.unwrap().size(), vec![1, 1, 3]);
    // topk_k = 2 truncates the 3-wide row and accepts the 2-wide one; weight mode keeps the stale row
    // at 0.5^(2 − 1) = 0.5.
    cfg.topk_k = 2;
    cfg.staleness = crate::trainer::Staleness::Weight;
    o.config = cfg;
    let packed = pack_samples(&[with_topk, narrow, stale], &o).unwrap();
    assert!(packed.dropped.is_empty(), "{:?}", packed.dropped);
    let b = packed.batch.unwrap();
    assert_eq!(Vec::<Vec<Vec<i64>>>::try_from(b.topk_ids.as_ref().unwrap()).unwrap(), vec![vec![vec![2, 3]]; 3]);
    assert_eq!(b.weights, vec![1.0, 1.0, 0.5]);
    // Nothing kept → no batch.
    let packed = pack_samples(&[sample("x", SampleType::Binary, &[1], &[2], &[-0.5], 1.0)], &o).unwrap();
    assert!(packed.batch.is_none());
    assert_eq!(packed.dropped[0].reason, DropReason::WrongMethod);
}

fn cand(id: &str, ids: Vec<Vec<i32>>, lps: Vec<Vec<f32>>, at_student: Vec<Vec<f32>>) -> crate::schema::TeacherCandidate {
    crate::schema::TeacherCandidate { teacher_id: id.into(), hint_index: 0, topk_ids: ids, topk_logprobs: lps, logprobs_at_student_topk: at_student }
}

#[test]
fn overlap_counts_and_the_three_selections_by_hand() {
    // S = [[1,2,3,4],[5,6,7,8]]; P0 = [[1,9,9,9],[5,6,7,8]] → O0 = [1, 4]; P1 = [[1,2,3,9],[5,9,9,9]] → O1 = [3, 1].
    let s = vec![vec![1, 2, 3, 4], vec![5, 6, 7, 8]];
    let o0 = overlap_counts(&s, &[vec![1, 9, 9, 9], vec![5, 6, 7, 8]]);
    let o1 = overlap_counts(&s, &[vec![1, 2, 3, 9], vec![5, 9, 9, 9]]);
    assert_eq!((o0.clone(), o1.clone()), (vec![1, 4], vec![3, 1]));
    let o = vec![o0, o1];
    assert_eq!(select_candidates(CandidateSelection::Shortest, &o, &[1, 1]), vec![0, 0]);
    assert_eq!(select_candidates(CandidateSelection::TokenOptimal, &o, &[1, 1]), vec![1, 0]);
    // Σ O0 = 5 > Σ O1 = 4 → candidate 0; with position 1 masked out, Σ O0 = 1 < Σ O1 = 3 → candidate 1.
    assert_eq!(select_candidates(CandidateSelection::SequenceOptimal, &o, &[1, 1]), vec![0, 0]);
    assert_eq!(select_candidates(CandidateSelection::SequenceOptimal, &o, &[1, 0]), vec![1, 1]);
    // Ties go to the shorter hint (lower k).
    assert_eq!(select_candidates(CandidateSelection::TokenOptimal, &[vec![2], vec![2]], &[1]), vec![0]);
}

/// An OPD row with two hint candidates over a 2-token response, K = 2.
fn candidate_sample() -> Sample {
    let mut a = sample("a", SampleType::Opd, &[5, 6], &[8, 9], &[-0.1, -0.2], 0.0);
    a.teacher_logprobs = Some(vec![-0.3, -0.4]);
    a.student_topk_ids = Some(vec![vec![8, 1], vec![9, 3]]);
    a.candidates = Some(vec![
        // candidate 0: P = [[8, 4], [7, 6]] → O = [1, 0]
        cand("t0", vec![vec![8, 4], vec![7, 6]], vec![vec![-0.2, -2.0], vec![-0.9, -1.1]], vec![vec![-0.2, -3.0], vec![-2.5, -2.6]]),
        // candidate 1: P = [[1, 8], [3, 9]] → O = [2, 2]
        cand("t1", vec![vec![1, 8], vec![3, 9]], vec![vec![-0.5, -0.6], vec![-0.7, -0.8]], vec![vec![-0.6, -0.5], vec![-0.8, -0.7]]),
    ]);
    a
}

#[test]
fn overlap_mode_packs_the_selected_candidates_ids_teacher_and_subset() {
    let mut o = opts(Method::Opd);
    o.config.opd_loss = OpdLoss::Overlap;
    o.config.recompute_old_logprobs = true;
    // sequence_optimal: Σ O0 = 1, Σ O1 = 4 → candidate 1 everywhere; subset = the student's ids.
    let p = pack_samples(&[candidate_sample()], &o).unwrap().batch.unwrap();
    assert_eq!(p.chosen_candidates, vec![vec![1, 1]]);
    assert_eq!(p.overlap_fraction, vec![Some(1.0)]);
    assert_eq!(Vec::<Vec<Vec<i64>>>::try_from(p.topk_ids.as_ref().unwrap()).unwrap(), vec![vec![vec![8, 1], vec![9, 3]]]);
    assert_eq!(Vec::<Vec<Vec<f32>>>::try_from(p.topk_logprobs.as_ref().unwrap()).unwrap(), vec![vec![vec![-0.6, -0.5], vec![-0.8, -0.7]]]);
    assert_eq!(Vec::<Vec<Vec<f32>>>::try_from(p.topk_subset.as_ref().unwrap()).unwrap(), vec![vec![vec![1.0, 1.0], vec![1.0, 1.0]]]);
    assert_eq!(f2(p.topk_mask.as_ref().unwrap()), vec![vec![1.0, 1.0]]);

    // shortest + teacher subset: candidate 0's own top-K ids and log-probs.
    o.config.overlap.selection = CandidateSelection::Shortest;
    o.config.overlap.subset = OverlapSubset::Teacher;
    let p = pack_samples(&[candidate_sample()], &o).unwrap().batch.unwrap();
    assert_eq!(p.chosen_candidates, vec![vec![0, 0]]);
    assert_eq!(p.overlap_fraction, vec![Some(0.25)], "O = [1, 0] of K = 2");
    assert_eq!(Vec::<Vec<Vec<i64>>>::try_from(p.topk_ids.as_ref().unwrap()).unwrap(), vec![vec![vec![8, 4], vec![7, 6]]]);
    assert_eq!(Vec::<Vec<Vec<f32>>>::try_from(p.topk_logprobs.as_ref().unwrap()).unwrap(), vec![vec![vec![-0.2, -2.0], vec![-0.9, -1.1]]]);

    // token_optimal + overlap subset: O0 = [1, 0], O1 = [2, 2] → candidate 1 at both positions;
    // S ∩ P1 = all of S at both positions. With shortest, S ∩ P0 = [8] then nothing.
    o.config.overlap.selection = CandidateSelection::TokenOptimal;
    o.config.overlap.subset = OverlapSubset::Overlap;
    let p = pack_samples(&[candidate_sample()], &o).unwrap().batch.unwrap();
    assert_eq!(p.chosen_candidates, vec![vec![1, 1]]);
    o.config.overlap.selection = CandidateSelection::Shortest;
    let p = pack_samples(&[candidate_sample()], &o).unwrap().batch.unwrap();
    assert_eq!(Vec::<Vec<Vec<f32>>>::try_from(p.topk_subset.as_ref().unwrap()).unwrap(), vec![vec![vec![1.0, 0.0], vec![0.0, 0.0]]]);
    assert_eq!(Vec::<Vec<Vec<f32>>>::try_from(p.topk_logprobs.as_ref().unwrap()).unwrap(), vec![vec![vec![-0.2, -3.0], vec![-2.5, -2.6]]]);
}

#[test]
fn overlap_mode_drops_rows_without_valid_candidates() {
    let mut o = opts(Method::Opd);
    o.config.opd_loss = OpdLoss::Overlap;
    o.config.recompute_old_logprobs = true;
    let mut none = candidate_sample();
    none.candidates = None;
    let mut narrow = candidate_sample();
    narrow.candidates.as_mut().unwrap()[1].topk_ids[1] = vec![3];
    let mut bad_id = candidate_sample();
    bad_id.student_topk_ids.as_mut().unwrap()[0][1] = 50;
    let mut nan = candidate_sample();
    nan.candidates.as_mut().unwrap()[0].logprobs_at_student_topk[1][0] = f32::NAN;
    let packed = pack_samples(&[none, narrow, bad_id, nan, candidate_sample()], &o).unwrap();
    let reasons: Vec<DropReason> = packed.dropped.iter().map(|d| d.reason).collect();
    assert_eq!(reasons, vec![DropReason::MissingTopk, DropReason::TopkWidth, DropReason::TokenOutOfVocab, DropReason::NonFinite]);
    assert_eq!(packed.dropped[1].detail, "candidate 1 topk_ids: width 1 at position 1, the student's is 2");
    assert_eq!(packed.batch.unwrap().batch_size(), 1);
}
