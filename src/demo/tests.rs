//! The GSM8K loader on the real file, number parsing, and the seeded split.

use proptest::prelude::*;

use super::*;
use crate::Error;

#[test]
fn loads_the_real_gsm8k_test_file() {
    let ps = load_gsm8k(default_gsm8k_path()).unwrap();
    assert_eq!(ps.len(), 1319);
    assert_eq!(ps[0].answer, "36"); // Carol and Jennifer: 100 - (20 + 44)
    assert!(ps[0].question.starts_with("Carol and Jennifer are sisters"));
    assert_eq!(ps[1].answer, "189"); // 4 painters, 3/8 of a day for 3 weeks: 24 * 3/8 * 21
    // "65,960" in the file: separators removed.
    assert_eq!(ps.iter().filter(|p| p.answer == "65960").count(), 1);
    assert_eq!(ps.iter().filter(|p| p.answer.starts_with('-')).count(), 2);
    assert!(ps.iter().enumerate().all(|(i, p)| p.id == i && !p.answer.contains(',')));
    assert!(ps.iter().all(|p| parse_number(&p.answer).is_some_and(|v| v.fract() == 0.0)));
}

#[test]
fn loader_takes_the_number_after_hashes_and_rejects_bad_rows() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g.json");
    std::fs::write(&p, r#"[{"question": "q1", "ground_truth_answer": "She has 3 + 4 = 7.\n#### 1,007"}, {"question": "q2", "ground_truth_answer": "$12.50"}]"#).unwrap();
    let ps = load_gsm8k(&p).unwrap();
    assert_eq!(ps.iter().map(|p| p.answer.as_str()).collect::<Vec<_>>(), vec!["1007", "12.5"]);
    std::fs::write(&p, r#"[{"question": "q", "ground_truth_answer": "seven"}]"#).unwrap();
    let e = load_gsm8k(&p).unwrap_err();
    assert!(e.to_string().contains("problem 0: ground_truth_answer \"seven\" is not a number"), "{e}");
    std::fs::write(&p, r#"[{"question": "q", "answer": "7"}]"#).unwrap();
    assert!(matches!(load_gsm8k(&p), Err(Error::Json(_))));
    assert!(matches!(load_gsm8k(dir.path().join("missing.json")), Err(Error::Io { .. })));
}

#[test]
fn numbers_parse_and_canonicalise() {
    assert_eq!(parse_number("1,234"), Some(1234.0));
    assert_eq!(parse_number(" $1234.0 "), Some(1234.0));
    assert_eq!(parse_number("-3"), Some(-3.0));
    for bad in ["", "-", "inf", "NaN", "1e5", ".5", "12a", "$"] {
        assert_eq!(parse_number(bad), None, "{bad}");
    }
    assert_eq!(canonical_answer("1,234.00").as_deref(), Some("1234"));
    assert_eq!(canonical_answer("2.50").as_deref(), Some("2.5"));
    assert_eq!(canonical_answer("-10").as_deref(), Some("-10"));
    assert!(same_number(0.1 + 0.2, 0.3));
    assert!(!same_number(36.0, 36.01));
}

#[test]
fn split_is_seeded_and_disjoint() {
    let ps = load_gsm8k(default_gsm8k_path()).unwrap();
    let a = split_problems(&ps, 100, 42).unwrap();
    assert_eq!((a.eval.len(), a.train.len()), (100, 1219));
    assert_eq!(a, split_problems(&ps, 100, 42).unwrap());
    assert_ne!(a.eval, split_problems(&ps, 100, 43).unwrap().eval);
    let e = split_problems(&ps, 1320, 1).unwrap_err();
    assert!(e.to_string().contains("1320 evaluation problems requested but only 1319 exist"), "{e}");
}

#[test]
fn a_validation_split_is_the_head_of_the_training_problems() {
    let ps: Vec<Problem> = (0..10).map(|id| Problem { id, question: format!("q{id}"), answer: "1".into() }).collect();
    let test = split_problems(&ps, 3, 5).unwrap();
    let ids = |v: &[Problem]| v.iter().map(|p| p.id).collect::<Vec<_>>();
    assert_eq!(test.clone().evaluated_on(EvalSplit::Test).unwrap(), test);
    let val = test.clone().evaluated_on(EvalSplit::Validation).unwrap();
    assert_eq!(ids(&val.eval), ids(&test.train[..3]));
    assert_eq!(ids(&val.train), ids(&test.train[3..]));
    // Too few training problems for a validation split as large as the evaluation.
    let e = split_problems(&ps, 6, 5).unwrap().evaluated_on(EvalSplit::Validation).unwrap_err();
    assert!(matches!(e, Error::Config(_)) && e.to_string().contains("a validation split of 6 problems needs at least 6 training problems; there are 4"), "{e}");
    // The demo's default split: the validation problems are the first 48 training problems.
    let gsm = load_gsm8k(default_gsm8k_path()).unwrap();
    let (t, v) = (split_problems(&gsm, 48, 7).unwrap(), split_problems(&gsm, 48, 7).unwrap().evaluated_on(EvalSplit::Validation).unwrap());
    assert_eq!((v.eval.len(), v.train.len()), (48, 1319 - 96));
    assert_eq!(ids(&v.eval), ids(&t.train[..48]));
}

proptest! {
    #[test]
    fn a_validation_split_never_meets_the_test_problems(n in 0usize..60, k in 0usize..30, seed: u64) {
        let ps: Vec<Problem> = (0..n).map(|id| Problem { id, question: format!("q{id}"), answer: "1".into() }).collect();
        let k = k.min(n / 2);
        let test = split_problems(&ps, k, seed).unwrap();
        let val = test.clone().evaluated_on(EvalSplit::Validation).unwrap();
        let test_ids: std::collections::BTreeSet<usize> = test.eval.iter().map(|p| p.id).collect();
        let val_ids: std::collections::BTreeSet<usize> = val.eval.iter().map(|p| p.id).collect();
        prop_assert_eq!(val.eval.len(), k);
        prop_assert!(val.eval.iter().chain(&val.train).all(|p| !test_ids.contains(&p.id)));
        prop_assert!(val.train.iter().all(|p| !val_ids.contains(&p.id)));
        let mut all: Vec<usize> = test.eval.iter().chain(&val.eval).chain(&val.train).map(|p| p.id).collect();
        all.sort();
        prop_assert_eq!(all, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn split_partitions_every_problem(n in 0usize..60, k in 0usize..60, seed: u64) {
        let ps: Vec<Problem> = (0..n).map(|id| Problem { id, question: format!("q{id}"), answer: "1".into() }).collect();
        let k = k.min(n);
        let s = split_problems(&ps, k, seed).unwrap();
        prop_assert_eq!(s.eval.len(), k);
        let mut ids: Vec<usize> = s.eval.iter().chain(&s.train).map(|p| p.id).collect();
        let eval_ids: std::collections::BTreeSet<usize> = s.eval.iter().map(|p| p.id).collect();
        prop_assert!(s.train.iter().all(|p| !eval_ids.contains(&p.id)));
        ids.sort();
        prop_assert_eq!(ids, (0..n).collect::<Vec<_>>());
    }
}

#[test]
fn evaluated_versions_are_v0_and_first_middle_last_loaded() {
    use super::run::versions_to_evaluate;
    assert_eq!(versions_to_evaluate(&[]), vec![0]);
    assert_eq!(versions_to_evaluate(&[3]), vec![0, 3]);
    assert_eq!(versions_to_evaluate(&[1, 2]), vec![0, 1, 2]);
    // 1..=9 loaded: the middle of 9 is the 5th
    assert_eq!(versions_to_evaluate(&(1..=9).collect::<Vec<_>>()), vec![0, 1, 5, 9]);
    // 10 loaded, one skipped by the server (versions 1..=11 but 4): middle = 5th of 10 = 6
    assert_eq!(versions_to_evaluate(&[1, 2, 3, 5, 6, 7, 8, 9, 10, 11]), vec![0, 1, 6, 11]);
    // out of order, repeated, and v0 itself are tolerated
    assert_eq!(versions_to_evaluate(&[4, 0, 2, 2, 3]), vec![0, 2, 3, 4]);
}

/// Found in the first online ablation: the student's seed also phrased the held-out questions, so
/// replicates sharing a split were evaluated on different prompts and v0 scored 0.312, 0.229 and 0.333.
#[test]
fn runs_that_share_a_split_get_the_same_heldout_prompts() {
    let problems = load_gsm8k(default_gsm8k_path()).unwrap();
    let opts = |seed: u64, split_seed: Option<u64>| run::DemoOptions {
        pipeline: crate::config::PipelineConfig::embedded_default(),
        out: "unused".into(),
        gsm8k: default_gsm8k_path(),
        interactions: 1,
        min_versions_served: 0,
        max_interactions: 1,
        students: 1,
        max_turns: 1,
        eval_problems: 48,
        eval_split: super::EvalSplit::Test,
        max_tokens: 8,
        temperature: 0.6,
        seed,
        split_seed,
        preferences: Preferences::default(),
        eval_last_only: false,
        context: run::AgentContext::None,
        train: true,
        fleet: vec![],
        v0_kept: None,
    };
    let prompts = |o: &run::DemoOptions| {
        let split = split_problems(&problems, o.eval_problems, o.split_seed.unwrap_or(o.seed)).unwrap();
        let st = run::heldout_student(o).unwrap();
        split.eval.iter().map(|p| st.first_message(p)).collect::<Vec<_>>()
    };
    let (a, b) = (prompts(&opts(1, Some(7))), prompts(&opts(2, Some(7))));
    assert_eq!(a, b, "replicates 1 and 2 of split 7");
    assert_eq!(a, prompts(&opts(7, None)), "the same as a run of seed 7");
    // Without a shared split the seed phrases them (and picks the problems).
    assert_ne!(prompts(&opts(1, None)), prompts(&opts(2, None)));
}
