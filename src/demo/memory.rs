//! The agent's memory of a user (the `memory` baseline of the ablations, [`crate::ablate::baselines`];
//! what a Mem0-style memory does): the accepted hints of earlier turns, written into the system prompt
//! of later requests, with no weight update.

/// Most tokens of remembered hints in the memory's system prompt.
pub const MEMORY_TOKENS: usize = 256;

/// The memory's system prompt from `hints` (accepted hints in the order they were given,
/// oldest first): the newest first, each once (exact text after trimming, case-insensitive), as long as
/// the list stays within `cap_tokens` tokens counted by `tokens`; `None` without any hint that fits.
/// The kept hints are listed oldest first under "Notes from earlier conversations with this user:".
pub fn memory_system(hints: &[String], cap_tokens: usize, tokens: impl Fn(&str) -> usize) -> Option<String> {
    let mut kept: Vec<&str> = vec![];
    let mut used = 0;
    for h in hints.iter().rev().map(|h| h.trim()).filter(|h| !h.is_empty()) {
        if kept.iter().any(|k| k.eq_ignore_ascii_case(h)) {
            continue;
        }
        let n = tokens(&format!("- {h}\n"));
        if used + n > cap_tokens {
            break;
        }
        used += n;
        kept.push(h);
    }
    if kept.is_empty() {
        return None;
    }
    kept.reverse();
    Some(format!("Notes from earlier conversations with this user:\n{}", kept.iter().map(|h| format!("- {h}")).collect::<Vec<_>>().join("\n")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> usize {
        s.split_whitespace().count()
    }

    #[test]
    fn memory_keeps_the_newest_distinct_hints_within_the_cap() {
        let hints: Vec<String> = ["Keep it short.", "Do not use bold text.", "keep it short.", "Put the final number at the end."].map(String::from).to_vec();
        // Newest first: "- Put ..." (8 words), "- keep it short." (4), "- Do not use bold text." (6) = 18.
        assert_eq!(
            memory_system(&hints, 18, words).as_deref(),
            Some("Notes from earlier conversations with this user:\n- Do not use bold text.\n- keep it short.\n- Put the final number at the end.")
        );
        // A cap of 12 keeps the two newest; the older "Keep it short." is a duplicate either way.
        assert_eq!(memory_system(&hints, 12, words).as_deref(), Some("Notes from earlier conversations with this user:\n- keep it short.\n- Put the final number at the end."));
        assert_eq!(memory_system(&hints, 7, words), None);
        assert_eq!(memory_system(&[], 100, words), None);
    }

}
