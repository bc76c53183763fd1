//! Tests of the hint stage: teacher context, the rule baseline (including a real log), and
//! `hint_turn` over a scripted backend.

use tokio::sync::Semaphore;

use super::*;
use crate::judge::VoteCache;
use crate::judge::tests::Scripted;
use crate::judge::mini_swe_agent_messages;
use crate::judge::turn_for_tests as turn;
use crate::schema::NextStateKind;

#[test]
fn separator_is_the_exact_string() {
    assert_eq!(HINT_SEPARATOR, "\n\n[user's hint / instruction]\n");
}

#[test]
fn teacher_context_appends_to_the_last_user_message() {
    let req = vec![
        Message::text("system", "sys"),
        Message::text("user", "first"),
        Message::text("assistant", "a"),
        Message::text("user", "Summarise the report."),
        Message::text("tool", "out"),
    ];
    let out = teacher_messages(&req, "  Keep it under 50 words.\n");
    assert_eq!(out.len(), 5);
    assert_eq!(out[3].content, "Summarise the report.\n\n[user's hint / instruction]\nKeep it under 50 words.");
    assert_eq!(out[3].role, "user");
    for i in [0, 1, 2, 4] {
        assert_eq!(out[i], req[i]);
    }
}

#[test]
fn teacher_context_without_user_message_uses_the_last_message() {
    let req = vec![Message::text("system", "sys"), Message::text("tool", "result")];
    let out = teacher_messages(&req, "Retry with --force.");
    assert_eq!(out[0], req[0]);
    assert_eq!(out[1].role, "tool");
    assert_eq!(out[1].content, "result\n\n[user's hint / instruction]\nRetry with --force.");
}

#[test]
fn teacher_context_without_messages_is_a_new_user_message() {
    let out = teacher_messages(&[], "Use metric units.");
    assert_eq!(out, vec![Message::text("user", "[user's hint / instruction]\nUse metric units.")]);
    // An empty target message gets no leading blank line either.
    let out = teacher_messages(&[Message::text("user", "")], "Use metric units.");
    assert_eq!(out[0].content, "[user's hint / instruction]\nUse metric units.");
}

#[test]
fn sentences_and_error_lines() {
    assert_eq!(first_sentences("No.  Use the v2 API! Then retry? And more. Extra.", 3), "No. Use the v2 API! Then retry?");
    assert_eq!(first_sentences("Line one\nline two\n\nline three\nfour", 3), "Line one line two line three");
    assert_eq!(first_sentences("version 1.2 is wrong, use 1.3", 1), "version 1.2 is wrong, use 1.3");
    assert_eq!(first_sentences("  ", 3), "");
    let tb = "Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\nZeroDivisionError: division by zero\n";
    assert_eq!(error_line(tb).as_deref(), Some("ZeroDivisionError: division by zero"));
    assert_eq!(error_line("all good\n").as_deref(), None);
    assert_eq!(error_line("Traceback (most recent call last):").as_deref(), Some("Traceback (most recent call last):"));
}

fn rule(t: &TurnContext) -> (Option<String>, &'static str) {
    RulesHint::VERBATIM.decide(t)
}

#[test]
fn rule_hint_cases() {
    let req = vec![Message::text("user", "Book the 9am flight.")];
    // A correction cue: the user's instruction is the hint.
    let mut t = turn(req.clone(), "Booked the 10am flight.", NextStateKind::User, "No, that's wrong. I said 9am.\nFix it now. Thanks. More text.");
    t.correction_cue = true;
    assert_eq!(rule(&t), (Some("No, that's wrong. I said 9am. Fix it now.".into()), "user_instruction"));
    // An instruction cue without a correction cue.
    let t = turn(req.clone(), "Booked.", NextStateKind::User, "Next time please confirm the seat first.");
    assert_eq!(rule(&t), (Some("Next time please confirm the seat first.".into()), "user_instruction"));
    // A plain new request: no hindsight.
    let t = turn(req.clone(), "Booked.", NextStateKind::User, "What is the weather in Oslo?");
    assert_eq!(rule(&t), (None, "no_hindsight"));
    // An environment error names the error line.
    let mut t = turn(req.clone(), "run", NextStateKind::Tool, "Traceback (most recent call last):\nKeyError: 'seat'\n");
    t.has_error = true;
    assert_eq!(
        rule(&t),
        (Some("The previous action failed with `KeyError: 'seat'`. Find and avoid the cause of this error before acting.".into()), "environment_error")
    );
    // A non-zero exit code with no error line.
    let mut t = turn(req.clone(), "run", NextStateKind::Environment, "(no output)");
    t.exit_code = Some(2);
    assert_eq!(rule(&t).0.as_deref(), Some("The previous action failed with exit code 2. Find and avoid the cause of this error before acting."));
    // A successful tool result: nothing to learn.
    let mut t = turn(req, "run", NextStateKind::Tool, "ok");
    t.exit_code = Some(0);
    assert_eq!(rule(&t), (None, "no_hindsight"));
}

#[test]
fn instruction_hints_rewrite_corrections_into_what_to_do() {
    let cases: &[(&str, Option<&str>)] = &[
        // The simulated student's phrasings (src/demo/student.rs) ...
        ("ugh, no bold text, just write it out like a normal message instead. also no labels like \"Step 1:\", can you explain it again like a friend would?",
            Some("Do not use bold text. Write it out like a normal message. Do not use labels like \"Step 1:\".")),
        ("way too long, can you do it again in a few sentences?", Some("Keep it short. Do it in a few sentences.")),
        ("hmm, I don't think that's right, can you check it again?", Some("Check the work and make sure the final answer is correct.")),
        ("you forgot to tell me the actual number at the end.", Some("Remember to tell the user the actual number at the end.")),
        ("can you put the final number at the very end instead?", Some("Put the final number at the very end.")),
        ("no code blocks, just plain text instead.", Some("Do not use code blocks. Use plain text.")),
        ("can you not use the bold and starred stuff and just write it normally instead?", Some("Do not use the bold and starred stuff. Write it normally.")),
        // The worked-steps student's (labeled_steps).
        ("can you show the work as numbered lines like Step 1: and Step 2: instead?", Some("Show the work as numbered lines like Step 1: and Step 2.")),
        ("ok but you forgot to number the steps, write it again with Step 1: and Step 2: lines ending with the answer.",
            Some("Remember to number the steps. Write it with Step 1: and Step 2: lines ending with the answer.")),
        ("I can't follow it like this, write it as steps like Step 1: and Step 2: instead.", Some("Write it as steps like Step 1: and Step 2.")),
        ("hmm, can you number the steps in order starting from Step 1: instead?", Some("Number the steps in order starting from Step 1.")),
        ("the step numbers jump around, write the steps again in order as Step 1: then Step 2: and so on.",
            Some("Write the steps in order as Step 1: then Step 2: and so on.")),
        // ... and other users' words.
        ("Please answer in French.", Some("Answer in French.")),
        ("No, that's wrong. I said 9am.\nFix it now. Thanks.", Some("Check the work and make sure the final answer is correct.")),
        ("Next time please confirm the seat first.", None),
        ("Don't push to main; open a pull request instead.", Some("Do not push to main. Open a pull request.")),
        ("I only need the SQL, not the explanation.", Some("Give the user only the SQL.")),
        ("The dates should be in ISO format.", Some("The dates should be in ISO format.")),
        ("it reads like a textbook.", None),
        ("can you try again?", None),
    ];
    for (text, want) in cases {
        assert_eq!(instruction_from(text).as_deref(), *want, "{text}");
    }
}

#[test]
fn instruction_style_falls_back_to_the_verbatim_hint_and_verbatim_style_copies() {
    let req = vec![Message::text("user", "Book the 9am flight.")];
    // Nothing to rewrite ("Next time please ..." starts with no verb): the verbatim hint.
    let t = turn(req.clone(), "Booked.", NextStateKind::User, "Next time please confirm the seat first.");
    assert_eq!(RulesHint::INSTRUCTION.decide(&t), (Some("Next time please confirm the seat first.".into()), "user_instruction"));
    let mut t = turn(req, "Booked the 10am flight.", NextStateKind::User, "Don't book the 10am one, take the 9am flight instead.");
    t.correction_cue = true;
    assert_eq!(RulesHint::INSTRUCTION.decide(&t).0.as_deref(), Some("Do not book the 10am one. Take the 9am flight."));
    assert_eq!(RulesHint::VERBATIM.decide(&t).0.as_deref(), Some("Don't book the 10am one, take the 9am flight instead."));
    assert_eq!(RulesHint::default().style, RuleHintStyle::Instruction);
}

#[test]
fn rule_answer_round_trips_through_the_parser() {
    let mut t = turn(vec![Message::text("user", "q")], "r", NextStateKind::User, "Please answer in French.");
    t.correction_cue = true;
    let raw = RulesHint::VERBATIM.answer(&t);
    assert_eq!(
        raw,
        "Rule-based hint judge hint-rules-v1 (a baseline, not an LLM). Rule `user_instruction` fired.\n\\boxed{1}\n[HINT_START]Please answer in French.[HINT_END]"
    );
    let p = parse_hint_vote(&raw);
    assert_eq!((p.score, p.hint.as_deref()), (Some(1), Some("Please answer in French.")));
    let t = turn(vec![], "r", NextStateKind::Tool, "fine");
    assert_eq!(parse_hint_vote(&RulesHint::VERBATIM.answer(&t)).score, Some(-1));
}

/// The mini-swe-agent log (real claude-sonnet-4 run): the first command reads a missing path and
/// the shell answers with exit code 1; the rule hint names the error line.
#[tokio::test]
async fn rule_hint_on_a_real_mini_swe_agent_log() {
    let msgs = mini_swe_agent_messages();
    let hinter = Hinter::new(HintConfig::default()).unwrap();
    // Turn 0: request = system + task, response = msgs[2], next state = msgs[3].
    let mut t = turn(msgs[..2].to_vec(), &msgs[2].content, NextStateKind::Environment, &msgs[3].content);
    t.exit_code = Some(1);
    let rec = hint_turn(&hinter, "p", &t).await;
    let hint = "The previous action failed with `cat: /Users/fuchur/Documents/24/git_sync/swe-agent-test-repo/tests/./missing_colon.py: No such file or directory`. Find and avoid the cause of this error before acting.";
    assert_eq!(rec.chosen_hint.as_deref(), Some(hint));
    assert_eq!(rec.chosen_index, Some(0));
    assert_eq!(rec.reason, format!("3 valid votes, 3 accepted, chose vote 0 (longest, {} chars)", hint.chars().count()));
    let teacher: Vec<Message> = serde_json::from_str(rec.teacher_messages.as_deref().unwrap()).unwrap();
    assert_eq!(teacher.len(), 2);
    assert_eq!(teacher[0], msgs[0]);
    assert_eq!(teacher[1].content, format!("{}{HINT_SEPARATOR}{hint}", msgs[1].content));
    // Turn 7 runs the script: a traceback; the hint names its last line.
    let mut t = turn(msgs[..16].to_vec(), &msgs[16].content, NextStateKind::Environment, &msgs[17].content);
    t.exit_code = Some(1);
    let rec = hint_turn(&hinter, "p", &t).await;
    let last_error = error_line(&msgs[17].content).unwrap();
    assert!(rec.chosen_hint.unwrap().contains(&format!("`{last_error}`")));
}

#[tokio::test]
async fn hint_record_from_scripted_votes() {
    let b = Scripted::new(vec![
        Ok("\\boxed{1}\n[HINT_START]Ask which date format the user wants.[HINT_END]".into()),
        Ok("Nothing to learn here. \\boxed{-1}".into()),
        Ok("\\boxed{1} [HINT_START] The user wants ISO dates (YYYY-MM-DD); convert all dates before replying. [HINT_END]".into()),
    ]);
    let cfg = HintConfig::default();
    let sem = Arc::new(Semaphore::new(4));
    let hinter = Hinter::with_parts(cfg, b.clone(), Arc::new(VoteCache::new()), sem).unwrap();
    let req = vec![Message::text("system", "s"), Message::text("user", "List the meetings.")];
    let t = turn(req.clone(), "Meetings: 3/4/2025 ...", NextStateKind::User, "Use ISO dates please.");
    let rec = hint_turn(&hinter, "demo", &t).await;
    let chosen = "The user wants ISO dates (YYYY-MM-DD); convert all dates before replying.";
    assert_eq!(rec.chosen_hint.as_deref(), Some(chosen));
    assert_eq!(rec.chosen_index, Some(2));
    assert_eq!(rec.reason, "3 valid votes, 2 accepted, chose vote 2 (longest, 73 chars)");
    assert_eq!(rec.candidates.iter().map(|c| c.score).collect::<Vec<_>>(), [Some(1), Some(-1), Some(1)]);
    assert_eq!(rec.candidates[1].hint, None);
    assert_eq!(rec.strategy, "longest");
    assert_eq!((rec.hint_backend.as_str(), rec.hint_model.as_str()), ("openai", "scripted"));
    assert_eq!(rec.template_id, "nextstate-hint-v1");
    assert_eq!(rec.template_hash, HINT_TEMPLATE.hash());
    assert_ne!(rec.template_hash, crate::judge::JUDGE_TEMPLATE.hash());
    assert_eq!(rec.hint_id, hinter.hint_id("demo", "i1"));
    assert_eq!(rec.teacher_prompt_text, None);
    assert_eq!(rec.cache_hits, 0);
    let teacher: Vec<Message> = serde_json::from_str(rec.teacher_messages.as_deref().unwrap()).unwrap();
    assert_eq!(teacher, teacher_messages(&req, chosen));
    assert_eq!(teacher[1].content, format!("List the meetings.\n\n[user's hint / instruction]\n{chosen}"));

    // A re-run is served from the cache, identical.
    let again = hint_turn(&hinter, "demo", &t).await;
    assert_eq!(again.cache_hits, 3);
    assert_eq!(b.total(), 3);
    assert_eq!((again.chosen_hint, again.hint_id), (rec.chosen_hint, rec.hint_id));
}

#[tokio::test]
async fn no_hint_means_no_teacher_context() {
    let b = Scripted::new(vec![Ok("\\boxed{1} [HINT_START]short[HINT_END]".into()), Ok("\\boxed{0}".into())]);
    let cfg = HintConfig { m: 2, ..HintConfig::default() };
    let hinter = Hinter::with_parts(cfg, b, Arc::new(VoteCache::new()), Arc::new(Semaphore::new(2))).unwrap();
    let rec = hint_turn(&hinter, "p", &turn(vec![], "r", NextStateKind::User, "ok")).await;
    assert_eq!((rec.chosen_hint, rec.chosen_index, rec.teacher_messages), (None, None, None));
    assert_eq!(rec.reason, "1 valid vote, 0 accepted: no vote with score 1 and a hint > 10 chars");
    assert_eq!(rec.candidates[1].error.as_deref(), Some("last \\boxed{} holds 0; a hint vote must be 1 or -1"));
}

#[test]
fn config_table_and_ids() {
    let cfg: HintConfig = toml::from_str("strategy = \"majority-gated\"\nm = 1\nmin_hint_chars = 20\n").unwrap();
    assert_eq!((cfg.strategy, cfg.m, cfg.min_hint_chars, cfg.temperature), (Strategy::MajorityGated, 1, 20, 0.6));
    assert!(toml::from_str::<HintConfig>("strategy = \"best\"").is_err());
    let e = toml::from_str::<HintConfig>("hint_len = 3").unwrap_err();
    assert!(e.to_string().contains("unknown field `hint_len`"), "{e}");
    let a = Hinter::new(HintConfig::default()).unwrap();
    let b = Hinter::new(HintConfig { strategy: Strategy::Shortest, ..HintConfig::default() }).unwrap();
    assert_ne!(a.hint_id("p", "x"), b.hint_id("p", "x"));
    assert_eq!(a.voter().backend().model(), "hint-rules-v1");
    let e = Hinter::new(HintConfig { concurrency: 0, ..HintConfig::default() }).unwrap_err();
    assert_eq!(e.to_string(), "config: [hint] concurrency = 0: must be >= 1");
}
