//! [`parse_timestamp`]: the timestamps of agent logs as ms since the Unix epoch.

/// Parses a log timestamp: epoch seconds or milliseconds (numbers above 1e11 are taken as ms),
/// RFC 3339, or a zone-less `YYYY-MM-DD[T ]HH:MM:SS[.f]` (read as UTC). Returns ms since the epoch.
pub fn parse_timestamp(v: &serde_json::Value) -> Option<i64> {
    match v {
        serde_json::Value::Number(n) => {
            let x = n.as_f64()?;
            if !x.is_finite() || x <= 0.0 {
                return None;
            }
            Some(if x > 1e11 { x as i64 } else { (x * 1000.0) as i64 })
        }
        serde_json::Value::String(s) => parse_time_str(s),
        _ => None,
    }
}

fn parse_time_str(s: &str) -> Option<i64> {
    let s = s.trim();
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Some(t.timestamp_millis());
    }
    for fmt in ["%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"] {
        if let Ok(t) = chrono::NaiveDateTime::parse_from_str(s, fmt) {
            return Some(t.and_utc().timestamp_millis());
        }
    }
    s.parse::<f64>().ok().and_then(|x| parse_timestamp(&serde_json::json!(x)))
}
