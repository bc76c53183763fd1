//! Token ids and rollout log-probs as the proxy records them: ids that are non-negative `i32`s,
//! log-probs that are finite, one per response token; anything else is dropped with a note. Pure
//! code, unit-tested below.

use serde_json::Value;

/// Token ids and log-probs after validation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenCapture {
    /// Prompt token ids.
    pub prompt_ids: Option<Vec<i32>>,
    /// Response token ids.
    pub response_ids: Option<Vec<i32>>,
    /// One log-prob (nats) per response token; only kept together with `response_ids`.
    pub logprobs: Option<Vec<f32>>,
    /// What was dropped and why.
    pub notes: Vec<String>,
    /// Something the upstream returned was invalid and dropped (counted as a mismatch).
    pub rejected: bool,
}

impl TokenCapture {
    /// Metric label: `ids_and_logprobs`, `ids_only`, `text_only` or `rejected`.
    pub fn kind(&self) -> &'static str {
        match (self.rejected, &self.response_ids, &self.logprobs) {
            (true, _, _) => "rejected",
            (false, Some(_), Some(_)) => "ids_and_logprobs",
            (false, Some(_), None) => "ids_only",
            _ => "text_only",
        }
    }
}

fn token_ids(v: &Value) -> std::result::Result<Vec<i32>, String> {
    let arr = v.as_array().ok_or_else(|| format!("not a list: {}", crate::ingest::normalize::json_type(v)))?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| x.as_u64().and_then(|u| i32::try_from(u).ok()).ok_or_else(|| format!("entry {i} ({x}) is not a token id")))
        .collect()
}

/// Validates what the upstream returned: ids are non-negative `i32`s, log-probs finite numbers, one
/// per response token. Invalid parts are dropped with a note and `rejected` set; log-probs without
/// response ids are dropped with a note (they cannot be aligned without re-tokenising).
pub fn validate_tokens(prompt: Option<&Value>, ids: Option<&Value>, logprobs: Option<&[Value]>) -> TokenCapture {
    let mut t = TokenCapture::default();
    if let Some(p) = prompt {
        match token_ids(p) {
            Ok(v) => t.prompt_ids = Some(v),
            Err(e) => {
                t.notes.push(format!("prompt_token_ids dropped: {e}"));
                t.rejected = true;
            }
        }
    }
    if let Some(r) = ids {
        match token_ids(r) {
            Ok(v) => t.response_ids = Some(v),
            Err(e) => {
                t.notes.push(format!("response token_ids dropped: {e}"));
                t.rejected = true;
            }
        }
    }
    if let Some(entries) = logprobs {
        let mut lps = Vec::with_capacity(entries.len());
        let mut bad = None;
        for (i, e) in entries.iter().enumerate() {
            match e.get("logprob").and_then(Value::as_f64) {
                Some(x) if x.is_finite() && (x as f32).is_finite() => lps.push(x as f32),
                _ => {
                    bad = Some(format!("log-prob {i} is missing or not finite ({})", e.get("logprob").unwrap_or(&Value::Null)));
                    break;
                }
            }
        }
        match (bad, &t.response_ids) {
            (Some(why), _) => {
                t.notes.push(format!("rollout log-probs dropped: {why}; token ids dropped too"));
                t.response_ids = None;
                t.rejected = true;
            }
            (None, None) if !t.rejected => {
                t.notes.push(format!("{} rollout log-probs dropped: the upstream returned no response token ids", lps.len()));
            }
            (None, None) => {}
            (None, Some(ids)) if ids.len() != lps.len() => {
                t.notes.push(format!("response token ids ({}) and log-probs ({}) differ in length; dropped both", ids.len(), lps.len()));
                t.response_ids = None;
                t.rejected = true;
            }
            (None, Some(_)) => t.logprobs = Some(lps),
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lp(x: f64) -> Value {
        json!({"token": "t", "logprob": x})
    }

    #[test]
    fn token_validation() {
        let ok = validate_tokens(Some(&json!([1, 2])), Some(&json!([5, 6])), Some(&[lp(-0.5), lp(-1.5)]));
        assert_eq!(ok.prompt_ids, Some(vec![1, 2]));
        assert_eq!(ok.response_ids, Some(vec![5, 6]));
        assert_eq!(ok.logprobs, Some(vec![-0.5, -1.5]));
        assert_eq!(ok.kind(), "ids_and_logprobs");
        assert!(ok.notes.is_empty());

        let short = validate_tokens(None, Some(&json!([5, 6])), Some(&[lp(-0.5)]));
        assert_eq!((short.response_ids.clone(), short.logprobs.clone(), short.kind()), (None, None, "rejected"));
        assert_eq!(short.notes, vec!["response token ids (2) and log-probs (1) differ in length; dropped both".to_string()]);

        let nan = validate_tokens(None, Some(&json!([5])), Some(&[json!({"logprob": null})]));
        assert_eq!((nan.response_ids.clone(), nan.logprobs.clone(), nan.kind()), (None, None, "rejected"));
        let huge = validate_tokens(None, Some(&json!([5])), Some(&[lp(-1e300)]));
        assert_eq!(huge.kind(), "rejected", "-1e300 is not a finite f32");

        let neg = validate_tokens(Some(&json!([-1])), Some(&json!([3])), None);
        assert_eq!((neg.prompt_ids.clone(), neg.response_ids.clone(), neg.kind()), (None, Some(vec![3]), "rejected"));

        let text = validate_tokens(None, None, Some(&[lp(-0.1)]));
        assert_eq!((text.logprobs.clone(), text.kind()), (None, "text_only"));
        assert_eq!(text.notes.len(), 1);
        assert_eq!(validate_tokens(None, Some(&json!([1])), None).kind(), "ids_only");
    }
}
