//! Fuzzes the judge-output parser (`nextstate::judge::parse_vote`, docs/method.md §2) on any text:
//! no panic; a vote is always 1, 0 or −1 and equals the last boxed digit; an error only when the
//! last boxed digit is missing or out of range.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nextstate::judge::{last_boxed_digit, parse_vote};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let digit = last_boxed_digit(&text);
    match parse_vote(&text) {
        Ok(v) => {
            assert!((-1..=1).contains(&v), "vote {v} out of range");
            assert_eq!(digit, Some(v));
        }
        Err(e) => {
            assert!(!e.is_empty());
            assert!(!matches!(digit, Some(-1..=1)), "valid digit {digit:?} rejected: {e}");
        }
    }
});
