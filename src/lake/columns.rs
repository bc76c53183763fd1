//! Narrow reads of one lake file: a few columns of every row (keys, flags), or whole rows at chosen
//! positions. Readers that only need to know *which* rows matter (catch-up, caches) scan the key columns
//! and then fetch just those rows, so their memory follows the rows they keep, not the table.
//!
//! A row's position is its 0-based number within its file, in the order every reader of the file sees
//! the rows ([`Lake::read_rows`], [`Lake::file_columns`]).

use std::fs::File;
use std::path::Path;

use parquet::arrow::arrow_reader::{ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection};
use parquet::arrow::ProjectionMask;
use parquet::file::metadata::PageIndexPolicy;
use parquet::file::reader::ChunkReader;
use serde::de::DeserializeOwned;

use super::{object_path, Lake};
use crate::error::{Error, Result};
use crate::schema::Table;

impl Lake {
    /// Every row of one file (a path from [`Lake::files`]) reduced to `columns`, as `P`: a record whose
    /// serde field names are those columns (file order of rows). Only those columns are read.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when a column is missing; [`Error::Parquet`] when the file is unreadable;
    /// [`Error::Records`] when the columns do not deserialize as `P`; [`Error::Unreachable`] when object
    /// storage fails.
    pub fn file_columns<P: DeserializeOwned>(&self, path: &Path, columns: &[&str]) -> Result<Vec<P>> {
        match &self.remote {
            Some(r) => columns_from(r.get(&object_path(path))?, path, columns),
            None => columns_from(File::open(path).map_err(|e| Error::io("open", path, e))?, path, columns),
        }
    }

    /// The whole rows of table `T` at `positions` of one file (a path from [`Lake::files`]), in
    /// ascending position order, each position once (`positions` may be unsorted or repeat). Only the
    /// row groups, and where the file has an offset index only the pages, that hold them are decoded.
    ///
    /// # Errors
    /// [`Error::InvalidInput`] when a position is past the file's last row; otherwise as
    /// [`Lake::read_rows`].
    pub fn read_rows_at<T: Table>(&self, path: &Path, positions: &[usize]) -> Result<Vec<T>> {
        let mut wanted = positions.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        if wanted.is_empty() {
            return Ok(vec![]);
        }
        match &self.remote {
            Some(r) => rows_at_from(r.get(&object_path(path))?, path, &wanted),
            None => rows_at_from(File::open(path).map_err(|e| Error::io("open", path, e))?, path, &wanted),
        }
    }
}

fn columns_from<P: DeserializeOwned, R: ChunkReader + 'static>(reader: R, path: &Path, columns: &[&str]) -> Result<Vec<P>> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(reader)?;
    let mut roots = Vec::with_capacity(columns.len());
    for c in columns {
        roots.push(builder.schema().index_of(c).map_err(|_| Error::InvalidInput(format!("no column {c} in {}", path.display())))?);
    }
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let mut out = vec![];
    for batch in builder.with_projection(mask).build()? {
        out.extend(serde_arrow::from_record_batch::<Vec<P>>(&batch?)?);
    }
    Ok(out)
}

/// `wanted`: ascending, distinct positions.
fn rows_at_from<T: Table, R: ChunkReader + 'static>(reader: R, path: &Path, wanted: &[usize]) -> Result<Vec<T>> {
    // The offset index (page locations) lets the reader skip the pages between the wanted rows.
    let options = ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
    let builder = ParquetRecordBatchReaderBuilder::try_new_with_options(reader, options)?;
    // Keep only the row groups holding a wanted row; positions then count within those groups.
    let (mut groups, mut ranges) = (vec![], vec![]);
    let (mut group_start, mut kept_rows, mut next) = (0usize, 0usize, 0usize);
    for (g, rg) in builder.metadata().row_groups().iter().enumerate() {
        let group_end = group_start + rg.num_rows() as usize;
        let first = next;
        while next < wanted.len() && wanted[next] < group_end {
            let at = kept_rows + wanted[next] - group_start;
            ranges.push(at..at + 1);
            next += 1;
        }
        if next > first {
            groups.push(g);
            kept_rows += group_end - group_start;
        }
        group_start = group_end;
    }
    if next < wanted.len() {
        return Err(Error::InvalidInput(format!("row {} is past the end of {} ({group_start} rows)", wanted[next], path.display())));
    }
    let selection = RowSelection::from_consecutive_ranges(ranges.into_iter(), kept_rows);
    let mut out = Vec::with_capacity(wanted.len());
    for batch in builder.with_row_groups(groups).with_row_selection(selection).build()? {
        out.extend(serde_arrow::from_record_batch::<Vec<T>>(&batch?)?);
    }
    Ok(out)
}
