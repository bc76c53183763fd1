//! The token ids the teacher scores: the student's own prompt and response ids of a turn
//! ([`turn_tokens`]) and the teacher contexts of a turn whose hint was accepted (`teacher_contexts`).
//!
//! Tokens: the interaction's own prompt/response token ids when the policy server logged them;
//! otherwise they are made once with the policy's tokenizer and chat template: the prompt is the
//! request rendered with the generation prompt, the response is what rendering the full conversation
//! adds after it, cut after the first end-of-turn token; `tokenize(prompt + response)` must start with
//! the prompt ids (docs/method.md §1), else the turn is dead-lettered.

use crate::error::{Error, Result};
use crate::hint::{candidate_hints, teacher_messages};
use crate::model::LanguageModel;
use crate::schema::{HintRecord, Interaction, Message};

/// Resolves the prompt and response token ids of a turn (see the module docs).
///
/// # Errors
/// [`Error::InvalidInput`] when the ids cannot be made consistently (the reason is the dead letter's).
pub fn turn_tokens(lm: &LanguageModel, i: &Interaction) -> Result<(Vec<u32>, Vec<u32>)> {
    if let (Some(p), Some(r)) = (&i.prompt_token_ids, &i.response_token_ids) {
        if !p.is_empty() && !r.is_empty() {
            let to_u32 = |v: &Vec<i32>| v.iter().map(|&x| u32::try_from(x).map_err(|_| Error::InvalidInput(format!("negative token id {x}")))).collect::<Result<Vec<u32>>>();
            return Ok((to_u32(p)?, to_u32(r)?));
        }
    }
    let messages = i.messages()?;
    let tools: Option<serde_json::Value> = match &i.tools {
        Some(t) => Some(serde_json::from_str(t)?),
        None => None,
    };
    let prompt_text = lm.render_chat(&messages, tools.as_ref(), true)?;
    let mut full = messages.clone();
    full.push(i.response_message()?);
    let full_text = lm.render_chat(&full, tools.as_ref(), false)?;
    let added = full_text
        .strip_prefix(&prompt_text)
        .ok_or_else(|| Error::InvalidInput("the chat template does not render the response as a continuation of the prompt".into()))?;
    let prompt_ids = lm.encode(&prompt_text)?;
    let joint = lm.encode(&format!("{prompt_text}{added}"))?;
    if !joint.starts_with(&prompt_ids) {
        return Err(Error::InvalidInput("tokenize(prompt + response) does not start with tokenize(prompt): unstable token boundary".into()));
    }
    let mut response_ids = joint[prompt_ids.len()..].to_vec();
    if let Some(pos) = response_ids.iter().position(|t| lm.eos_token_ids().contains(t)) {
        response_ids.truncate(pos + 1);
    }
    Ok((prompt_ids, response_ids))
}

/// The teacher contexts of a turn whose hint was accepted, as `(vote index, messages)`: with
/// `candidates = 1` the hint stage's own context (`hints.teacher_messages`); with more, one per
/// [`candidate_hints`] entry (docs/method.md §3b), built from the turn's request with [`teacher_messages`]
/// (the same construction as the hint stage's), the chosen hint alone when no vote qualifies.
///
/// # Errors
/// [`Error::InvalidInput`] for an accepted hint without a teacher context; JSON errors for a context or
/// request that is not a message list.
pub(crate) fn teacher_contexts(hint: Option<&HintRecord>, interaction: &Interaction, candidates: usize, min_hint_chars: usize) -> Result<Vec<(i32, Vec<Message>)>> {
    let h = hint.ok_or_else(|| Error::InvalidInput("accepted hint without a hint record".into()))?;
    if candidates > 1 {
        let mut hints = candidate_hints(&h.candidates, min_hint_chars, candidates);
        if hints.is_empty() {
            if let Some(chosen) = &h.chosen_hint {
                hints.push((h.chosen_index.unwrap_or(0), chosen.clone()));
            }
        }
        if !hints.is_empty() {
            let request = interaction.messages()?;
            return Ok(hints.into_iter().map(|(i, text)| (i, teacher_messages(&request, &text))).collect());
        }
    }
    let ctx = h.teacher_messages.as_ref().ok_or_else(|| Error::InvalidInput("accepted hint without teacher context".into()))?;
    Ok(vec![(h.chosen_index.unwrap_or(0), serde_json::from_str(ctx)?)])
}
