//! [`content_hash`]: the hash of content-addressed ids and cache keys.

/// Hex sha256 of the given parts (each length-prefixed so that ("ab","c") ≠ ("a","bc")), truncated
/// to 32 hex characters (128 bits). Used for content-addressed ids and cache keys.
pub fn content_hash(parts: &[&[u8]]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(&h.finalize()[..16])
}
