//! Hand-checked verdicts, reply phrasing, and the check that the pipeline's rule-based judge and hint
//! judge read the student's replies as intended.

use super::*;
use crate::hint::RulesHint;
use crate::judge::{turn_for_tests as turn, RulesJudge};
use crate::schema::{Message, NextStateKind};
use crate::signals::features::{classify, features, render};

fn carol() -> Problem {
    // Problem 0 of data/gsm8k_test.json (20 + 44 signatures, goal 100).
    Problem { id: 0, question: "Carol has 20 signatures and Jennifer has 44. How many more to reach 100?".into(), answer: "36".into() }
}

fn kinds(v: &Verdict) -> Vec<ViolationKind> {
    v.violations.iter().map(|x| x.kind).collect()
}

fn shown(v: &Verdict) -> Vec<String> {
    v.violations.iter().map(|x| x.to_string()).collect()
}

#[test]
fn all_patterns_compile() {
    for r in [&*THINK, &*BOLD, &*ITALICS, &*HEADER, &*LIST, &*LATEX, &*FENCE, &*STEP_LABEL, &*WORD_LABEL, &*STEP_START, &*BULLET_LIKE, &*NUMBER] {
        assert!(!r.as_str().is_empty());
    }
}

#[test]
fn plain_short_correct_answer_satisfies_everything() {
    let r = "Carol has 20 and Jennifer has 44, so they have 64 together. They need 100 - 64 = 36 more signatures, so the answer is 36.";
    let v = check(r, &carol(), &Preferences::default());
    assert_eq!(v.violations, vec![]);
    assert!(v.satisfied && v.correct);
    assert_eq!(v.words, 24); // "-" and "=" are not words
    assert_eq!(v.last_number.as_deref(), Some("36"));
}

#[test]
fn bold_step_labels() {
    let r = "**Step 1:** Add 20 and 44 to get 64.\n**Step 2:** Subtract from 100 to get 36.";
    let v = check(r, &carol(), &Preferences::default());
    assert_eq!(shown(&v), vec!["bold text: `**Step 1:**`", "label: `Step 1:`"]);
    assert_eq!(v.violations[0].tagged(), "no_markdown: bold text: `**Step 1:**`");
    assert!(!v.satisfied && v.correct);
    // With no_markdown off only the label is left.
    let prefs = Preferences { no_markdown: false, ..Preferences::default() };
    assert_eq!(kinds(&check(r, &carol(), &prefs)), vec![ViolationKind::Label]);
}

#[test]
fn header_list_latex() {
    let r = "## Solution\n1. They have 20 + 44 = 64.\n2. They need \\(100 - 64 = 36\\).\n\nThe answer is \\boxed{36}.";
    let v = check(r, &carol(), &Preferences::default());
    assert_eq!(
        shown(&v),
        vec!["header: `## Solution`", "list: `1. They have 20 + 44 = 64.`", "LaTeX: `\\(100 - 64 = 36\\).`"]
    );
    assert!(v.correct);
}

#[test]
fn italics_but_not_multiplication() {
    let v = check("They need *exactly* 36.", &carol(), &Preferences::default());
    assert_eq!(shown(&v), vec!["italics: `*exactly*`"]);
    for r in ["3 * 12 = 36, so they need 36.", "2*18 is 36.", "100 - 64 is 36."] {
        assert!(check(r, &carol(), &Preferences::default()).satisfied, "{r}");
    }
}

#[test]
fn code_fence_and_bullet_like_lines() {
    let v = check("```\n100 - 64 = 36\n```\nSo 36.", &carol(), &Preferences::default());
    assert_eq!(shown(&v), vec!["code fence: `````"]);
    let v = check("• 20 + 44 = 64\n• 100 - 64 = 36", &carol(), &Preferences::default());
    assert_eq!(shown(&v), vec!["bullet-like line: `• 20 + 44 = 64`"]);
    assert!(v.correct);
    // A markdown dash list is a list, not a bullet-like line.
    let v = check("- 20 + 44 = 64\n- 100 - 64 = 36", &carol(), &Preferences::default());
    assert_eq!(kinds(&v), vec![ViolationKind::List]);
}

#[test]
fn plain_labels() {
    let v = check("Answer: 36", &carol(), &Preferences::default());
    assert_eq!(shown(&v), vec!["label: `Answer:`"]);
    let v = check("They have 64. Final answer: they need 36.", &carol(), &Preferences::default());
    assert_eq!(shown(&v), vec!["label: `Final answer:`"]);
    // "the answer is" is a sentence, not a label.
    assert!(check("So the answer is 36.", &carol(), &Preferences::default()).satisfied);
}

#[test]
fn too_long() {
    let r = format!("{}so the answer is 36.", "word ".repeat(79));
    let v = check(&r, &carol(), &Preferences::default());
    assert_eq!(shown(&v), vec!["too long: 84 words, limit 80"]);
    let prefs = Preferences { max_words: 84, ..Preferences::default() };
    assert!(check(&r, &carol(), &prefs).satisfied);
}

#[test]
fn wrong_missing_and_misplaced_answers() {
    let p = Preferences::default();
    let v = check("They need 34 more signatures.", &carol(), &p);
    assert_eq!(shown(&v), vec!["wrong answer: last number is 34, expected 36"]);
    assert!(!v.correct);
    // The right number followed by another number: the last number decides.
    let v = check("The answer is 36, out of 100.", &carol(), &p);
    assert_eq!(shown(&v), vec!["wrong answer: last number is 100, expected 36"]);
    let v = check("I am not sure.", &carol(), &p);
    assert_eq!(shown(&v), vec!["wrong answer: no number, expected 36", "no number: no number in the response"]);
    assert_eq!(v.violations.iter().map(|x| x.preference).collect::<Vec<_>>(), vec![Preference::CorrectAnswer, Preference::AnswerAtEnd]);
    let v = check("They need 36 more signatures. Hope that helps!", &carol(), &p);
    assert_eq!(shown(&v), vec!["final number not at the end: last sentence has no number: `Hope that helps!`"]);
    assert!(v.correct);
    // An emoji after the answer is not a sentence.
    assert!(check("They need 36 more. 🙂", &carol(), &p).satisfied);
    // Wrong and not at the end: two preferences violated.
    let v = check("It is 34. Hope that helps!", &carol(), &p);
    assert_eq!(kinds(&v), vec![ViolationKind::WrongAnswer, ViolationKind::AnswerNotAtEnd]);
    // With correct_answer off a wrong answer is not a violation, but still not correct.
    let off = Preferences { correct_answer: false, ..p.clone() };
    let v = check("They need 34 more signatures.", &carol(), &off);
    assert!(v.satisfied && !v.correct);
    let off = Preferences { answer_at_end: false, ..p };
    let v = check("They need 36 more signatures. Hope that helps!", &carol(), &off);
    assert!(v.satisfied && v.correct);
}

#[test]
fn numbers_are_normalised() {
    let p = Problem { id: 9, question: "q".into(), answer: "1234".into() };
    for r in ["It is 1,234.", "It is $1234.", "It is 1234.0", "It costs $1,234.00 in total."] {
        let v = check(r, &p, &Preferences::default());
        assert!(v.correct && v.satisfied, "{r}: {v:?}");
    }
    let neg = Problem { id: 1, question: "q".into(), answer: "-3".into() };
    assert!(check("The change is -3.", &neg, &Preferences::default()).correct);
    // A minus glued to a digit is subtraction: 47, not -47.
    assert_eq!(numbers("44-47"), vec![(0, "44".to_string()), (3, "47".to_string())]);
    assert_eq!(check("44-47", &neg, &Preferences::default()).last_number.as_deref(), Some("47"));
}

#[test]
fn reasoning_is_not_visible() {
    let v = check("<think>**Step 1:** 20+44=64, 99 maybe</think>They need 36 more.", &carol(), &Preferences::default());
    assert!(v.satisfied, "{v:?}");
    assert_eq!(visible_text("a<think>x"), "a");
    assert_eq!(count_words("** - = hello 36"), 2);
}

#[test]
fn sentences() {
    let t = "It is 3.5 km. Then 36!\nok";
    let spans: Vec<&str> = sentence_spans(t).into_iter().map(|(s, e)| t[s..e].trim()).collect();
    assert_eq!(spans, vec!["It is 3.5 km.", "Then 36!", "ok"]);
}

// ---- replies ----

fn student(seed: u64) -> Student {
    Student::new(seed, Preferences::default(), 3).unwrap()
}

#[test]
fn zero_max_turns_is_a_config_error() {
    let e = Student::new(1, Preferences::default(), 0).unwrap_err();
    assert!(e.to_string().contains("max_turns must be at least 1, got 0"), "{e}");
}

#[test]
fn thanks_when_satisfied() {
    let mut s = student(1);
    let r = s.reply("They need 100 - 64 = 36 more, so 36.", &carol());
    assert!(r.satisfied && r.correct && r.session_done);
    assert!(THANKS.contains(&r.text.as_str()), "{}", r.text);
    assert!(r.mentioned.is_empty() && r.violations.is_empty());
    assert_eq!(r.turn, 1);
}

#[test]
fn corrections_name_the_first_two_problems() {
    let s = student(1);
    let bold = "**Step 1:** Add 20 and 44 to get 64.\n**Step 2:** Subtract from 100 to get 36.";
    let r = s.reply_at(bold, &carol(), 1);
    assert_eq!(r.mentioned, vec![ViolationKind::Bold, ViolationKind::Label]);
    assert!(!r.satisfied && r.correct && !r.session_done);
    // A wrong answer comes first, then the first style problem.
    let r = s.reply_at("## Work\n- They need **34**.", &carol(), 1);
    assert_eq!(r.mentioned, vec![ViolationKind::WrongAnswer, ViolationKind::Bold]);
    assert_eq!(r.violations.len(), 4); // bold, header, list, wrong answer
    let r = s.reply_at("I am not sure.", &carol(), 1);
    assert_eq!(r.mentioned, vec![ViolationKind::NoNumber]);
    // A list and bullet-like lines get one correction between them.
    let r = s.reply_at("- 64\n• so 36", &carol(), 1);
    assert_eq!(r.mentioned, vec![ViolationKind::List]);
    let r = s.reply_at("It is 34. Hope that helps!", &carol(), 1);
    assert_eq!(r.mentioned, vec![ViolationKind::WrongAnswer, ViolationKind::AnswerNotAtEnd]);
    // The student reacts to enabled preferences only: with correct_answer off a wrong answer gets thanks.
    let off = Student::new(1, Preferences { correct_answer: false, ..Preferences::default() }, 3).unwrap();
    let r = off.reply_at("They need 34.", &carol(), 1);
    assert!(r.satisfied && !r.correct && r.violations.is_empty() && r.mentioned.is_empty());
    assert!(THANKS.contains(&r.text.as_str()));
    // With answer_at_end off a missing number is still "you forgot the number" (correct_answer).
    let off = Student::new(1, Preferences { answer_at_end: false, ..Preferences::default() }, 3).unwrap();
    assert_eq!(off.reply_at("no idea", &carol(), 1).mentioned, vec![ViolationKind::NoNumber]);
}

#[test]
fn replies_are_deterministic_per_seed_and_turn() {
    let bold = "**Step 1:** Add 20 and 44 to get 64.\n**Step 2:** Subtract from 100 to get 36.";
    let a = student(7).reply_at(bold, &carol(), 1);
    let b = student(7).reply_at(bold, &carol(), 1);
    assert_eq!(a, b);
    // Pinned: rand 0.8 StdRng (locked in Cargo.lock) seeded from sha256 of (seed, "reply", problem, turn, response).
    assert_eq!(a.text, PINNED_SEED7_TURN1);
    assert_eq!(student(7).first_message(&carol()), PINNED_ASK_SEED7);
    // The counter in `reply` gives turns 1, 2, 3 and ends the session at max_turns.
    let mut s = student(7);
    assert_eq!(s.start_session(&carol()), PINNED_ASK_SEED7);
    let r1 = s.reply(bold, &carol());
    let r2 = s.reply(bold, &carol());
    let r3 = s.reply(bold, &carol());
    assert_eq!((r1.turn, r2.turn, r3.turn), (1, 2, 3));
    assert_eq!(r1.text, a.text);
    assert!(!r1.session_done && !r2.session_done && r3.session_done);
    s.start_session(&carol());
    assert_eq!(s.reply(bold, &carol()).text, a.text);
    // Phrasing varies across seeds.
    let texts: std::collections::BTreeSet<String> = (0..20).map(|seed| student(seed).reply_at(bold, &carol(), 1).text).collect();
    assert!(texts.len() >= 5, "{texts:?}");
    let asks: std::collections::BTreeSet<String> = (0..20).map(|seed| student(seed).first_message(&carol())).collect();
    assert!(asks.len() >= 4, "{asks:?}");
    for a in &asks {
        assert!(a.contains(carol().question.as_str()), "{a}");
    }
}

const PINNED_SEED7_TURN1: &str =
    "ugh, no bold text, just write it out like a normal message instead. also no labels like \"Step 1:\", can you explain it again like a friend would?";
const PINNED_ASK_SEED7: &str = "can you help me with this one? Carol has 20 signatures and Jennifer has 44. How many more to reach 100?";

/// What the pipeline makes of a student reply: the signal stage's kind and features, then the
/// rule-based judge's vote and the rule-based hint judge's hint.
fn pipeline_view(request: &str, response: &str, reply: &str) -> (NextStateKind, i32, &'static str, Option<String>) {
    let ns = vec![Message::text("user", reply)];
    let f = features(&ns);
    let mut t = turn(vec![Message::text("user", request)], response, classify(&ns), reply);
    t.next_state_text = render(&ns);
    t.has_error = f.has_error;
    t.exit_code = f.exit_code;
    t.correction_cue = f.correction_cue;
    t.thanks_cue = f.thanks_cue;
    t.success_cue = f.success_cue;
    let (vote, rule, _) = RulesJudge::decide(&t);
    let (hint, _) = RulesHint::VERBATIM.decide(&t);
    (t.next_state_kind, vote, rule, hint)
}

#[test]
fn every_correction_is_read_as_a_correction_with_the_reply_as_hint() {
    use ViolationKind::*;
    let ask = student(0).first_message(&carol());
    let all = [Bold, Italics, Header, List, Latex, CodeFence, TooLong, Label, BulletLike, WrongAnswer, NoNumber, AnswerNotAtEnd, MissingSteps, MisnumberedSteps];
    let mut checked = 0;
    for k1 in all {
        for t1 in corrections(k1) {
            for o in OPENERS {
                for (k2, t2, c) in all.iter().flat_map(|&k2| corrections(k2).iter().flat_map(move |t2| CONNECTORS.iter().map(move |c| (k2, *t2, *c)))) {
                    if k2 == k1 {
                        continue;
                    }
                    for text in [format!("{o}{t1}"), format!("{o}{t1} {c}{t2}")] {
                        let text = text.replace("{label}", "\"Step 1:\"");
                        let (kind, vote, rule, hint) = pipeline_view(&ask, "**36**", &text);
                        assert_eq!(kind, NextStateKind::User, "{text}");
                        assert_eq!((vote, rule), (-1, "correction_cue"), "{text}");
                        assert_eq!(hint.as_deref(), Some(text.as_str()), "{text}");
                        assert!(!features(&[Message::text("user", &text)]).thanks_cue, "{text}");
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 5000, "{checked}");
}

/// The rule backend's default `instruction` style turns every correction the student writes into an
/// instruction of its own (never the complaint copied, never the verbatim fallback): capitalised
/// sentences ending with a period, addressed to the assistant (no "I"/"me" of the student).
#[test]
fn every_correction_becomes_an_instruction_hint() {
    use ViolationKind::*;
    let all = [Bold, Italics, Header, List, Latex, CodeFence, TooLong, Label, BulletLike, WrongAnswer, NoNumber, AnswerNotAtEnd, MissingSteps, MisnumberedSteps];
    let mut checked = 0;
    for k in all {
        for t in corrections(k) {
            for o in OPENERS {
                let text = format!("{o}{t}").replace("{label}", "\"Step 1:\"");
                let hint = crate::hint::instruction_from(&text).unwrap_or_else(|| panic!("no instruction from {text:?}"));
                assert_ne!(hint, text);
                assert!(hint.chars().count() > 10 && hint.ends_with('.') && hint.starts_with(char::is_uppercase), "{text:?} -> {hint:?}");
                assert!(![" I ", " me ", " my ", "I'm"].iter().any(|w| format!(" {hint} ").contains(w)), "{text:?} -> {hint:?}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, all.iter().map(|k| corrections(*k).len()).sum::<usize>() * OPENERS.len());
}

#[test]
fn every_thanks_is_read_as_thanks_without_hint() {
    let ask = student(0).first_message(&carol());
    for t in THANKS {
        let (kind, vote, rule, hint) = pipeline_view(&ask, "They need 36.", t);
        assert_eq!((kind, vote, rule, hint), (NextStateKind::User, 1, "thanks_cue", None), "{t}");
    }
}

#[test]
fn real_replies_on_real_problems_are_read_as_intended() {
    let problems = crate::demo::load_gsm8k(crate::demo::default_gsm8k_path()).unwrap();
    let responses = [
        "**Answer:** {a}",
        "Let me think. The answer is {a}.",
        "The answer is {a}. Hope this helps!",
        "The answer is 1.",
        "## Steps\n1. Read.\n2. Compute.\nSo it is {a}.",
        "We compute \\(x\\) and get \\boxed{{a}}",
    ];
    let mut s = student(3);
    let (mut corrections_seen, mut thanks_seen) = (0, 0);
    for p in problems.iter().take(40) {
        let ask = s.start_session(p);
        for r in responses {
            let r = r.replace("{a}", &p.answer);
            let reply = s.reply_at(&r, p, 1);
            let (_, vote, rule, hint) = pipeline_view(&ask, &r, &reply.text);
            if reply.satisfied {
                assert_eq!((vote, rule, hint), (1, "thanks_cue", None), "{}", reply.text);
                thanks_seen += 1;
            } else {
                assert_eq!((vote, rule), (-1, "correction_cue"), "{}", reply.text);
                assert_eq!(hint.as_deref(), Some(reply.text.as_str()));
                corrections_seen += 1;
            }
        }
    }
    assert_eq!((thanks_seen, corrections_seen), (40, 200));
}



// ---- the second student: labeled steps ----

const PLAIN: &str = "Carol has 20 and Jennifer has 44, so they have 64 together. They need 100 - 64 = 36 more signatures, so the answer is 36.";
const STEPS: &str = "Step 1: Carol and Jennifer have 20 + 44 = 64 signatures.\nStep 2: They need 100 - 64 = 36 more, so the answer is 36.";

fn worked(seed: u64) -> Student {
    Student::new(seed, Preferences::worked_steps(), 3).unwrap()
}

#[test]
fn labeled_steps_on_lines_or_in_one_paragraph() {
    let p = Preferences::worked_steps();
    let answer42 = Problem { id: 5, question: "q".into(), answer: "42".into() };
    let v = check("Step 1: Add 20 and 22 to get 42. Step 2: Nothing else is left. The answer is 42.", &answer42, &p);
    assert!(v.satisfied, "{v:?}");
    assert!(check(STEPS, &carol(), &p).satisfied);
    // Any case, spaces or none after "step", a line before the steps, the answer in the last step.
    let v = check("Let's work it out.\nstep 1: 20 + 44 = 64\nSTEP2: 100 - 64 = 36, so they need 36.", &carol(), &p);
    assert!(v.satisfied, "{v:?}");
    assert_eq!(step_numbers("Step 1: a. Step 2: b! step 3: c? Step 4: d\n  Step 5: e"), vec![1, 2, 3, 4, 5]);
}

#[test]
fn missing_and_misnumbered_steps() {
    let p = Preferences::worked_steps();
    let shown_for = |r: &str| shown(&check(r, &carol(), &p));
    assert_eq!(shown_for(PLAIN), vec!["missing steps: found 0 step labels, need at least 2"]);
    assert_eq!(shown_for("Step 1: 100 - 64 = 36."), vec!["missing steps: found 1 step label, need at least 2"]);
    assert_eq!(shown_for("Step 2: 100 - 64 = 36.\nStep 1: so the answer is 36."), vec!["misnumbered steps: steps numbered 2, 1, expected 1, 2"]);
    assert_eq!(shown_for("Step 1: 20 + 44 = 64. Step 3: 100 - 64 = 36."), vec!["misnumbered steps: steps numbered 1, 3, expected 1, 2"]);
    assert_eq!(shown_for("Step 1: 64. Step 2: 36. Step 2: 36."), vec!["misnumbered steps: steps numbered 1, 2, 2, expected 1, 2, 3"]);
    let many: String = (0..12).map(|i| format!("Step {}: 36.\n", 12 - i)).collect();
    assert_eq!(
        shown_for(&many),
        vec!["misnumbered steps: steps numbered 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, …, expected 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, …"]
    );
    // Not step labels: in the middle of a sentence, `Step 1)`, the colon after markdown, hidden reasoning.
    for r in [
        "After step 1: we add 20 and 44, and in step 2: we take 64 from 100 to get 36.",
        "Step 1) add.\nStep 2) subtract to get 36.",
        "**Step 1**: add.\n**Step 2**: subtract to get 36.",
        "__Step 1:__ add.\n__Step 2:__ subtract to get 36.",
        "<think>Step 1: a. Step 2: b.</think>They need 36.",
    ] {
        let v = check(r, &carol(), &p);
        assert_eq!(v.violations.iter().filter(|x| x.kind == ViolationKind::MissingSteps).count(), 1, "{r}: {v:?}");
    }
}

#[test]
fn step_labels_are_seen_through_markdown() {
    let p = Preferences::worked_steps();
    // `**Step 1:**` shows the steps; the bold is no_markdown's complaint, not a missing step.
    let v = check("**Step 1:** 20 + 44 = 64.\n**Step 2:** 100 - 64 = 36.", &carol(), &p);
    assert_eq!(kinds(&v), vec![ViolationKind::Bold]);
    assert!(v.meets(Preference::LabeledSteps));
    let v = check("- Step 1: 20 + 44 = 64.\n- Step 2: 100 - 64 = 36.", &carol(), &p);
    assert_eq!(kinds(&v), vec![ViolationKind::List]);
    let v = check("### Step 1: add\n### Step 2: subtract, 36", &carol(), &p);
    assert_eq!(kinds(&v), vec![ViolationKind::Header]);
}

#[test]
fn the_two_students_never_agree_on_style() {
    let (default, steps) = (Preferences::default(), Preferences::worked_steps());
    let responses = [
        PLAIN,
        STEPS,
        "Step 1: Add 20 and 44. Step 2: Take 64 from 100. They need 36.",
        "**Step 1:** 20 + 44 = 64.\n**Step 2:** 100 - 64 = 36.",
        "__Step 1:__ 64.\n__Step 2:__ 36.",
        "Step1: 64\nStep2: 36",
        "Answer: 36",
        "Step 2: 100 - 64 = 36.\nStep 1: so the answer is 36.",
    ];
    for r in responses {
        let (d, w) = (check(r, &carol(), &default), check(r, &carol(), &steps));
        assert!(!(d.meets(Preference::PlainSentences) && w.meets(Preference::LabeledSteps)), "{r}");
    }
    assert!(check(PLAIN, &carol(), &default).satisfied && !check(PLAIN, &carol(), &steps).satisfied);
    assert!(check(STEPS, &carol(), &steps).satisfied && !check(STEPS, &carol(), &default).satisfied);
    // The default student still hears about labels, in its own words.
    assert_eq!(student(1).reply_at(STEPS, &carol(), 1).mentioned, vec![ViolationKind::Label]);
}

#[test]
fn conflicting_preferences_are_refused() {
    assert!(Preferences::default().validate().is_ok());
    assert!(Preferences::worked_steps().validate().is_ok());
    let both = Preferences { labeled_steps: true, ..Preferences::default() };
    let e = both.validate().unwrap_err();
    assert!(e.to_string().contains("plain_sentences and labeled_steps conflict"), "{e}");
    let e = Student::new(1, both, 3).unwrap_err();
    assert!(e.to_string().contains("plain_sentences and labeled_steps conflict"), "{e}");
}

#[test]
fn labeled_steps_is_named_last_and_serialised_only_when_on() {
    assert_eq!(Preference::ALL.map(Preference::name), ["no_markdown", "concise", "plain_sentences", "answer_at_end", "correct_answer", "labeled_steps"]);
    assert_eq!(Preference::from_name("labeled_steps"), Some(Preference::LabeledSteps));
    let w = Preferences::worked_steps();
    assert_eq!(w.enabled(), vec![Preference::NoMarkdown, Preference::AnswerAtEnd, Preference::CorrectAnswer, Preference::LabeledSteps]);
    assert_eq!(w.describe().last().map(String::as_str), Some("labeled_steps: the work as at least 2 lines or sentences starting `Step 1:`, `Step 2:`, … in order"));
    assert_eq!(Preferences::default().enabled().len(), 5);
    // The default serialises as before labeled_steps existed (configurations that hold it keep their hashes).
    assert_eq!(
        serde_json::to_string(&Preferences::default()).unwrap(),
        r#"{"no_markdown":true,"concise":true,"max_words":80,"plain_sentences":true,"answer_at_end":true,"correct_answer":true}"#
    );
    let json = serde_json::to_string(&w).unwrap();
    assert_eq!(json, r#"{"no_markdown":true,"concise":false,"max_words":80,"plain_sentences":false,"labeled_steps":true,"answer_at_end":true,"correct_answer":true}"#);
    assert_eq!(serde_json::from_str::<Preferences>(&json).unwrap(), w);
    assert_eq!(toml::from_str::<Preferences>("").unwrap(), Preferences::default());
    assert_eq!(toml::from_str::<Preferences>("concise = false\nplain_sentences = false\nlabeled_steps = true").unwrap(), w);
    assert!(toml::from_str::<Preferences>("labelled_steps = true").is_err());
}

/// The worked-steps student's complaints, as generated for several seeds, are corrections to the rule
/// judge (−1), the whole reply to the verbatim hint judge, and an instruction naming the steps to the
/// default (instruction) hint judge.
#[test]
fn worked_steps_complaints_are_read_as_corrections_with_step_hints() {
    let cases = [
        (PLAIN, ViolationKind::MissingSteps),
        ("Step 1: 100 - 64 = 36.", ViolationKind::MissingSteps),
        ("Step 2: 100 - 64 = 36.\nStep 1: so the answer is 36.", ViolationKind::MisnumberedSteps),
    ];
    let mut texts = std::collections::BTreeSet::new();
    for seed in 0..12 {
        let s = worked(seed);
        let ask = s.first_message(&carol());
        for (r, kind) in cases {
            let reply = s.reply_at(r, &carol(), 1);
            assert_eq!(reply.mentioned, vec![kind], "{r}");
            assert!(!reply.satisfied && reply.correct && !reply.session_done);
            let (next, vote, rule, hint) = pipeline_view(&ask, r, &reply.text);
            assert_eq!((next, vote, rule), (NextStateKind::User, -1, "correction_cue"), "{}", reply.text);
            assert_eq!(hint.as_deref(), Some(reply.text.as_str()));
            let instruction = crate::hint::instruction_from(&reply.text).unwrap_or_else(|| panic!("no instruction from {:?}", reply.text));
            assert!(instruction.contains("Step 1") && instruction != reply.text, "{:?} -> {instruction:?}", reply.text);
            texts.insert(reply.text);
        }
        // A second complaint joins the first, as for the default student.
        let reply = s.reply_at("**Step 1:** 64. They need 36.", &carol(), 1);
        assert_eq!(reply.mentioned, vec![ViolationKind::Bold, ViolationKind::MissingSteps]);
        assert_eq!(pipeline_view(&ask, "x", &reply.text).1, -1);
        assert!(THANKS.contains(&s.reply_at(STEPS, &carol(), 1).text.as_str()));
    }
    assert!(texts.len() >= 4, "{texts:?}");
}
