//! Streaming readers: JSONL line by line, JSON arrays element by element, bounded whole documents.

use std::cell::Cell;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::rc::Rc;

use serde::de::{DeserializeSeed, Error as _, SeqAccess, Visitor};
use serde_json::Value;

use crate::{Error, Result};

/// The UTF-8 byte-order mark some editors and Windows tools write at the start of a text file.
pub const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// A reader that counts the bytes it hands out.
pub(crate) struct Counting<R> {
    inner: R,
    count: Rc<Cell<u64>>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.set(self.count.get() + n as u64);
        Ok(n)
    }
}

/// How a log file is compressed, by its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain text.
    None,
    /// `.gz` (gzip; concatenated members are read as one stream).
    Gzip,
    /// `.zst` (Zstandard).
    Zstd,
}

impl Compression {
    /// The compression of `path`, by its last extension (`.gz`, `.zst`).
    pub fn of(path: &Path) -> Compression {
        match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("gz") => Compression::Gzip,
            Some("zst" | "zstd") => Compression::Zstd,
            _ => Compression::None,
        }
    }
}

/// Opens a log file for reading its (decompressed) content. Only a regular file is read: the file is
/// opened without blocking (a FIFO would otherwise wait in `open()` for a writer) and refused when it
/// turns out to be anything else (FIFO, socket, device, directory).
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened, is not a regular file (`InvalidInput`), or the zstd
/// frame header cannot be read.
///
/// A leading UTF-8 byte-order mark ([`UTF8_BOM`]) is skipped, so the first line of a
/// file saved "with BOM" parses like the others (looked for in the first read, which holds at least
/// 3 bytes for any file or decompressed stream of that size).
pub fn open(path: &Path) -> Result<Box<dyn Read>> {
    let f = open_regular(path)?;
    let r: Box<dyn Read> = match Compression::of(path) {
        Compression::None => Box::new(f),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(BufReader::with_capacity(1 << 16, f))),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(f).map_err(|e| Error::io("open zstd stream", path, e))?),
    };
    let mut b = BufReader::with_capacity(1 << 16, r);
    if b.fill_buf().map_err(|e| Error::io("read", path, e))?.starts_with(UTF8_BOM) {
        b.consume(UTF8_BOM.len());
    }
    Ok(Box::new(b))
}

/// Opens `path` read-only if it is a regular file. On Unix with `O_NONBLOCK`, which never blocks
/// `open()` (a FIFO without a writer would) and changes nothing for reads of a regular file.
fn open_regular(path: &Path) -> Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NONBLOCK);
    }
    let f = o.open(path).map_err(|e| Error::io("open", path, e))?;
    let meta = f.metadata().map_err(|e| Error::io("stat", path, e))?;
    if !meta.is_file() {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file (a FIFO, socket, device or directory)");
        return Err(Error::io("open", path, e));
    }
    Ok(f)
}

/// One JSONL line handed to the callback.
pub(crate) enum Line<'a> {
    /// The line's bytes without the line end (`\n` or `\r\n`).
    Text(&'a [u8]),
    /// The line was longer than the limit; its first bytes and full length.
    TooLong { head: &'a [u8], len: u64 },
}

/// Calls `f(line_number, line)` for every non-blank line of a JSONL file (1-based line numbers),
/// reading at most `limit` bytes of (decompressed) content when given.
/// Returns (bytes read, blank lines skipped).
///
/// # Errors
/// [`Error::Io`] on read errors; errors from `f`.
pub(crate) fn for_each_line(path: &Path, max_line: usize, limit: Option<u64>, progress: &mut dyn FnMut(u64), f: &mut dyn FnMut(i64, Line<'_>, u64) -> Result<()>) -> Result<(u64, u64)> {
    let mut r = BufReader::with_capacity(1 << 16, open(path)?.take(limit.unwrap_or(u64::MAX)));
    let mut buf: Vec<u8> = Vec::new();
    let mut line_no = 0i64;
    let mut bytes = 0u64;
    let mut blank = 0u64;
    loop {
        buf.clear();
        let n = (&mut r).take(max_line as u64 + 1).read_until(b'\n', &mut buf).map_err(|e| Error::io("read", path, e))?;
        if n == 0 {
            break;
        }
        bytes += n as u64;
        line_no += 1;
        let ended = buf.last() == Some(&b'\n');
        if !ended && buf.len() > max_line {
            // Skip the rest of the over-long line without keeping it.
            let mut len = buf.len() as u64;
            loop {
                let avail = r.fill_buf().map_err(|e| Error::io("read", path, e))?;
                if avail.is_empty() {
                    break;
                }
                match avail.iter().position(|&b| b == b'\n') {
                    Some(p) => {
                        len += p as u64 + 1;
                        r.consume(p + 1);
                        break;
                    }
                    None => {
                        let k = avail.len();
                        len += k as u64;
                        r.consume(k);
                    }
                }
            }
            bytes += len - buf.len() as u64;
            let head = &buf[..buf.len().min(1 << 16)];
            f(line_no, Line::TooLong { head, len }, bytes)?;
            progress(bytes);
            continue;
        }
        let mut end = buf.len();
        if ended {
            end -= 1;
            if end > 0 && buf[end - 1] == b'\r' {
                end -= 1;
            }
        }
        let text = &buf[..end];
        if text.iter().all(|b| b.is_ascii_whitespace()) {
            blank += 1;
            continue;
        }
        f(line_no, Line::Text(text), bytes)?;
        progress(bytes);
    }
    Ok((bytes, blank))
}

/// How a streamed JSON array ended.
#[derive(Debug)]
pub(crate) enum ArrayEnd {
    /// All elements read.
    Complete,
    /// The document is not an array (its JSON type, or a parse error at the start).
    NotAnArray(String),
    /// A parse error after `elements` complete elements (truncated or malformed JSON).
    Broken { elements: i64, error: String },
}

struct ElementsVisitor<'a> {
    f: &'a mut dyn FnMut(i64, Value) -> Result<()>,
    failed: &'a mut Option<Error>,
    done: &'a Cell<i64>,
}

impl<'de> Visitor<'de> for ElementsVisitor<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON array")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let mut i = 0i64;
        while let Some(v) = seq.next_element::<Value>()? {
            i += 1;
            self.done.set(i);
            if let Err(e) = (self.f)(i, v) {
                *self.failed = Some(e);
                return Err(A::Error::custom("callback failed"));
            }
        }
        Ok(())
    }
}

struct ElementsSeed<'a>(ElementsVisitor<'a>);

impl<'de> DeserializeSeed<'de> for ElementsSeed<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_seq(self.0)
    }
}

/// Streams the elements of a top-level JSON array, calling `f(index, element)` with 1-based indices,
/// one element in memory at a time. Returns the bytes read and how the array ended.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened; errors from `f`. Malformed JSON is reported in
/// [`ArrayEnd`], not as an error.
pub(crate) fn for_each_element(path: &Path, progress: &mut dyn FnMut(u64), f: &mut dyn FnMut(i64, Value) -> Result<()>) -> Result<(u64, ArrayEnd)> {
    let count = Rc::new(Cell::new(0u64));
    let reader = BufReader::with_capacity(1 << 16, Counting { inner: open(path)?, count: count.clone() });
    let mut de = serde_json::Deserializer::from_reader(reader);
    let mut failed: Option<Error> = None;
    let done = Cell::new(0i64);
    let result = {
        let c = count.clone();
        let mut cb = |i: i64, v: Value| -> Result<()> {
            let r = f(i, v);
            progress(c.get());
            r
        };
        let seed = ElementsSeed(ElementsVisitor { f: &mut cb, failed: &mut failed, done: &done });
        let r = seed.deserialize(&mut de);
        match r {
            Ok(()) => de.end().map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    };
    if let Some(e) = failed {
        return Err(e);
    }
    let end = match result {
        Ok(()) => ArrayEnd::Complete,
        Err(msg) if done.get() == 0 && (msg.starts_with("invalid type") || msg.contains("expected a JSON array")) => ArrayEnd::NotAnArray(msg),
        Err(msg) => ArrayEnd::Broken { elements: done.get(), error: msg },
    };
    Ok((count.get(), end))
}

/// A whole document, or its head when it is larger than the limit.
pub(crate) enum Document {
    /// The full bytes.
    Whole(Vec<u8>),
    /// The file is larger than the limit: its size and first 64 KiB.
    TooLarge { size: u64, head: Vec<u8> },
}

/// Reads a whole file of at most `max` bytes (of decompressed content).
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened or read (including corrupt compressed data).
pub(crate) fn read_document(path: &Path, max: u64) -> Result<Document> {
    if Compression::of(path) == Compression::None {
        let size = std::fs::metadata(path).map_err(|e| Error::io("stat", path, e))?.len();
        if size > max {
            let mut head = vec![0u8; 1 << 16];
            let n = open(path)?.read(&mut head).map_err(|e| Error::io("read", path, e))?;
            head.truncate(n);
            return Ok(Document::TooLarge { size, head });
        }
    }
    let mut buf = Vec::new();
    open(path)?.take(max + 1).read_to_end(&mut buf).map_err(|e| Error::io("read", path, e))?;
    if buf.len() as u64 > max {
        // Compressed: the decompressed size is only known by reading; report what was read.
        let size = buf.len() as u64;
        buf.truncate(1 << 16);
        return Ok(Document::TooLarge { size, head: buf });
    }
    Ok(Document::Whole(buf))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn tmp(content: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(content).unwrap();
        f
    }

    #[test]
    fn lines_crlf_blank_and_too_long() {
        let f = tmp(b"{\"a\":1}\r\n\r\n   \n{\"b\":2}\n0123456789012345678901234567890\n{\"c\":3}");
        let mut seen: Vec<(i64, String)> = vec![];
        let (bytes, blank) = for_each_line(f.path(), 20, None, &mut |_| {}, &mut |n, l, _| {
            seen.push(match l {
                Line::Text(t) => (n, String::from_utf8_lossy(t).into_owned()),
                Line::TooLong { len, .. } => (n, format!("too long {len}")),
            });
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, vec![(1, "{\"a\":1}".into()), (4, "{\"b\":2}".into()), (5, "too long 32".into()), (6, "{\"c\":3}".into())]);
        assert_eq!(blank, 2);
        assert_eq!(bytes, 62);
    }

    #[test]
    fn array_elements_stream_and_truncation_is_reported() {
        let f = tmp(b"[{\"x\":1}, {\"x\":2}, {\"x\":");
        let mut got = vec![];
        let (_, end) = for_each_element(f.path(), &mut |_| {}, &mut |i, v| {
            got.push((i, v));
            Ok(())
        })
        .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1], (2, serde_json::json!({"x": 2})));
        match end {
            ArrayEnd::Broken { elements, error } => {
                assert_eq!(elements, 2);
                assert!(error.contains("EOF"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        let g = tmp(b"{\"not\": \"array\"}");
        let (_, end) = for_each_element(g.path(), &mut |_| {}, &mut |_, _| Ok(())).unwrap();
        assert!(matches!(end, ArrayEnd::NotAnArray(_)), "{end:?}");
        let h = tmp(b" [ ] ");
        let (_, end) = for_each_element(h.path(), &mut |_| {}, &mut |_, _| Ok(())).unwrap();
        assert!(matches!(end, ArrayEnd::Complete));
    }

    #[cfg(unix)]
    #[test]
    fn fifos_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe.jsonl");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let t = std::time::Instant::now();
        let e = open(&fifo).err().expect("a FIFO is refused");
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "open took {:?}", t.elapsed());
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = open(dir.path()).err().expect("a directory is refused");
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    #[test]
    fn callback_errors_propagate() {
        let f = tmp(b"[1,2,3]");
        let r = for_each_element(f.path(), &mut |_| {}, &mut |i, _| {
            if i == 2 {
                Err(Error::Cancelled)
            } else {
                Ok(())
            }
        });
        assert!(matches!(r, Err(Error::Cancelled)));
    }
}
