//! Server-sent events as the proxy relays them: [`SseFramer`] splits an upstream byte stream into
//! events and keeps each event's raw bytes, so an event is forwarded exactly as it came (comments,
//! `event:`/`id:` lines and line endings included) unless its data had to be rewritten, which
//! [`SseEvent::with_data`] does. Pure code, unit-tested below.
//!
//! Not `eventsource-stream`: it yields parsed events only (no raw bytes, comments dropped), drops an
//! unterminated last event at the end of the stream and stops at invalid UTF-8, all of which the
//! proxy needs to keep.

/// Splits server-sent events out of a byte stream: each event ends with a blank line (`\n\n`,
/// `\r\n\r\n` or `\r\r`). Keeps the raw bytes of each event so it can be forwarded unchanged.
#[derive(Debug, Default)]
pub struct SseFramer {
    buf: Vec<u8>,
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The event's bytes as received, terminator included.
    pub raw: Vec<u8>,
    /// Its `data:` lines joined with `\n` (None for events without data: comments, keep-alives).
    pub data: Option<String>,
}

impl SseEvent {
    fn parse(raw: Vec<u8>) -> SseEvent {
        let text = String::from_utf8_lossy(&raw);
        let mut data: Option<String> = None;
        for line in text.split(['\n', '\r']) {
            if let Some(rest) = line.strip_prefix("data:") {
                let rest = rest.strip_prefix(' ').unwrap_or(rest);
                match &mut data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(rest);
                    }
                    None => data = Some(rest.to_string()),
                }
            }
        }
        SseEvent { raw, data }
    }

    /// The event with its data replaced by `data` (other lines dropped), as SSE bytes.
    pub fn with_data(data: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(data.len() + 8);
        for line in data.split('\n') {
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(line.as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
        out
    }
}

fn event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < buf.len() {
        match (buf[i], buf[i + 1]) {
            (b'\n', b'\n') | (b'\r', b'\r') => return Some(i + 2),
            (b'\r', b'\n') if buf.get(i + 2..i + 4) == Some(b"\r\n") => return Some(i + 4),
            _ => i += 1,
        }
    }
    None
}

impl SseFramer {
    /// Adds bytes; returns the events completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = vec![];
        while let Some(end) = event_end(&self.buf) {
            let rest = self.buf.split_off(end);
            let raw = std::mem::replace(&mut self.buf, rest);
            out.push(SseEvent::parse(raw));
        }
        out
    }

    /// True when bytes of an unfinished event are held (the stream stopped inside an event).
    pub fn has_partial(&self) -> bool {
        !self.buf.iter().all(|b| b.is_ascii_whitespace())
    }

    /// The unterminated last event, if the stream ended without a blank line.
    pub fn finish(&mut self) -> Option<SseEvent> {
        if self.buf.iter().all(|b| b.is_ascii_whitespace()) {
            return None;
        }
        Some(SseEvent::parse(std::mem::take(&mut self.buf)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_framer_splits_across_chunks_and_line_endings() {
        let mut f = SseFramer::default();
        assert!(f.push(b"data: {\"a\"").is_empty());
        let ev = f.push(b":1}\n\ndata: x\r\n\r\n: keep-alive\n\ndata: a\ndata: b\n\n");
        assert_eq!(ev.len(), 4);
        assert_eq!(ev[0].data.as_deref(), Some("{\"a\":1}"));
        assert_eq!(ev[0].raw, b"data: {\"a\":1}\n\n");
        assert_eq!(ev[1].data.as_deref(), Some("x"));
        assert_eq!(ev[2].data, None);
        assert_eq!(ev[3].data.as_deref(), Some("a\nb"));
        assert_eq!(SseEvent::with_data("a\nb"), b"data: a\ndata: b\n\n");
        assert!(f.finish().is_none());
        f.push(b"data: [DONE]");
        assert_eq!(f.finish().and_then(|e| e.data).as_deref(), Some("[DONE]"));
    }
}
