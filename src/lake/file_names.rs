//! The names of lake files: their parts joined by [`SEP`], the stem of a Kafka sink's file
//! ([`kafka_stem`]), and the [`FileOrigin`] a name encodes ([`parse_stem`]).

/// Separator between the parts of a lake file name (not valid in Kafka topic names).
pub(super) const SEP: char = '~';

/// The origin encoded in a lake file's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileOrigin {
    /// Written by the Kafka sink: offsets `first..=last` of `topic`/`partition` on cluster `source`.
    Kafka {
        /// Cluster identity (cluster id of a real cluster; `mock-<uuid>` for the embedded one).
        source: String,
        /// Topic name.
        topic: String,
        /// Partition.
        partition: i32,
        /// First offset in the file.
        first: i64,
        /// Last offset in the file.
        last: i64,
    },
    /// Written directly by a writer (`writer` id, sequence numbers `seq..=last_seq`: one number for a
    /// file as written, a range for files merged by `nextstate compact`).
    Direct {
        /// Writer id.
        writer: String,
        /// (First) sequence number.
        seq: u64,
        /// Last sequence number (`seq` for a file as written).
        last_seq: u64,
    },
}

/// File stem for rows `first..=last` of a Kafka partition.
pub fn kafka_stem(source: &str, topic: &str, partition: i32, first: i64, last: i64) -> String {
    format!("k{SEP}{}{SEP}{}{SEP}p{partition:04}{SEP}{first:020}-{last:020}", sanitize(source), sanitize(topic))
}

pub(crate) fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' })
        .collect()
}

pub(crate) fn parse_stem(stem: &str) -> Option<FileOrigin> {
    let parts: Vec<&str> = stem.split(SEP).collect();
    match parts.as_slice() {
        ["k", source, topic, p, range] => {
            let partition = p.strip_prefix('p')?.parse().ok()?;
            let (a, b) = range.split_once('-')?;
            Some(FileOrigin::Kafka {
                source: source.to_string(),
                topic: topic.to_string(),
                partition,
                first: a.parse().ok()?,
                last: b.parse().ok()?,
            })
        }
        ["w", writer, seqs] => {
            let (a, b) = seqs.split_once('-').unwrap_or((seqs, seqs));
            Some(FileOrigin::Direct { writer: writer.to_string(), seq: a.parse().ok()?, last_seq: b.parse().ok()? })
        }
        _ => None,
    }
}
