//! The tenant key: which agent or person of a fleet a record belongs to.
//!
//! Every table has a nullable `tenant` column (utf8). The proxy takes it from a request header
//! (`X-Agent-Id`, then `X-User-Id` by default; `[proxy] tenant_headers`), ingest from `--tenant NAME`
//! (or the log, where a format names its agent or user); every later stage copies it from the row it
//! reads. A record without one belongs to [`DEFAULT_TENANT`]: new rows are written with
//! `"default"`, and a null is only found in rows written before the column existed, where it means
//! the same ([`tenant_or_default`]).
//!
//! A tenant id is 1–[`MAX_TENANT_LEN`] ASCII characters from `[A-Za-z0-9_.@-]`, beginning with a
//! letter or digit ([`validate_tenant`]): it becomes a Kafka message key, a Prometheus label value and
//! a folder name (`checkpoints/<run>/<tenant>/<version>`), so it can hold nothing that needs escaping
//! in any of them. `@` is allowed because logs name users by e-mail address (OpenAI's `user`).

/// Request headers naming the tenant, lower-case, in order of preference (the first present wins): the
/// capture proxy's default list, also read from the `headers` of logged requests at ingest.
pub const TENANT_HEADERS: [&str; 2] = ["x-agent-id", "x-user-id"];

/// The tenant of a record that names none: `"default"`.
pub const DEFAULT_TENANT: &str = "default";

/// The longest tenant id accepted, in bytes (= ASCII characters): 64.
pub const MAX_TENANT_LEN: usize = 64;

/// Why a tenant id was refused ([`validate_tenant`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// The id is the empty string.
    #[error("tenant id is empty")]
    Empty,
    /// The id is longer than [`MAX_TENANT_LEN`] bytes.
    #[error("tenant id is {len} bytes long; at most {max} are allowed")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// [`MAX_TENANT_LEN`].
        max: usize,
    },
    /// The id holds a character outside `[A-Za-z0-9_.@-]`, or begins with another than a letter or digit.
    #[error("tenant id {id:?} has {what} {ch:?} at byte {at}; use letters, digits, '_', '.', '@' and '-', beginning with a letter or digit")]
    BadChar {
        /// The refused id, cut to [`MAX_TENANT_LEN`] characters.
        id: String,
        /// `"the character"` or `"the first character"`.
        what: &'static str,
        /// The refused character.
        ch: char,
        /// Its byte offset in the id.
        at: usize,
    },
}

/// Checks a tenant id: 1–64 characters from `[A-Za-z0-9_.@-]`, the first a letter or digit.
///
/// # Errors
/// [`TenantError`] saying what is wrong (empty, too long, which character where).
pub fn validate_tenant(id: &str) -> Result<(), TenantError> {
    if id.is_empty() {
        return Err(TenantError::Empty);
    }
    for (at, ch) in id.char_indices() {
        let ok = if at == 0 { ch.is_ascii_alphanumeric() } else { ch.is_ascii_alphanumeric() || matches!(ch, '_' | '.' | '@' | '-') };
        if !ok {
            let what = if at == 0 { "the first character" } else { "the character" };
            return Err(TenantError::BadChar { id: id.chars().take(MAX_TENANT_LEN).collect(), what, ch, at });
        }
    }
    if id.len() > MAX_TENANT_LEN {
        return Err(TenantError::TooLong { len: id.len(), max: MAX_TENANT_LEN });
    }
    Ok(())
}

/// The key under which per-session state of `tenant`'s session `session_id` is kept (turn counters,
/// duplicate checks, pairing): the session id itself for the default tenant (or none), else the two
/// joined by U+001F, so two tenants' sessions of one id are two sessions.
pub fn tenant_session_key(tenant: Option<&str>, session_id: &str) -> String {
    match tenant {
        Some(t) if t != DEFAULT_TENANT => format!("{t}\u{1f}{session_id}"),
        _ => session_id.to_string(),
    }
}

/// The tenant a `tenant` column value stands for: the value itself, or [`DEFAULT_TENANT`] for null.
pub fn tenant_or_default(tenant: Option<&str>) -> &str {
    tenant.unwrap_or(DEFAULT_TENANT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_ids_are_checked_for_charset_first_character_and_length() {
        for ok in ["default", "alice", "agent-7", "team_a.bot-2", "0", "ann@example.com", &"a".repeat(64)] {
            assert_eq!(validate_tenant(ok), Ok(()), "{ok}");
        }
        assert_eq!(validate_tenant(""), Err(TenantError::Empty));
        assert_eq!(validate_tenant(&"a".repeat(65)), Err(TenantError::TooLong { len: 65, max: 64 }));
        assert!(matches!(validate_tenant("@x"), Err(TenantError::BadChar { at: 0, .. })));
        assert_eq!(validate_tenant("-x"), Err(TenantError::BadChar { id: "-x".into(), what: "the first character", ch: '-', at: 0 }));
        assert_eq!(validate_tenant("a b"), Err(TenantError::BadChar { id: "a b".into(), what: "the character", ch: ' ', at: 1 }));
        assert_eq!(validate_tenant("ali/ce"), Err(TenantError::BadChar { id: "ali/ce".into(), what: "the character", ch: '/', at: 3 }));
        assert_eq!(validate_tenant("zoë"), Err(TenantError::BadChar { id: "zoë".into(), what: "the character", ch: 'ë', at: 2 }));
        let msg = validate_tenant("a\"b").unwrap_err().to_string();
        assert_eq!(msg, "tenant id \"a\\\"b\" has the character '\"' at byte 1; use letters, digits, '_', '.', '@' and '-', beginning with a letter or digit");
        assert_eq!(tenant_or_default(None), "default");
        assert_eq!(tenant_or_default(Some("bob")), "bob");
    }
}
