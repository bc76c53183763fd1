//! A lake on object storage: `--lake s3://bucket/prefix` (S3 and S3-compatible servers) and
//! `--lake az://container/prefix` (Azure Blob Storage; also `azure://`), through the `object_store` crate
//! that DataFusion already uses.
//!
//! The same layout as on a local disk (`<prefix>/<table>/date=YYYY-MM-DD/<name>.parquet`), the same
//! file names, the same exactly-once rule: a file is written with one PUT, conditional on the object not
//! existing ([`PutMode::Create`]), so a sink that re-writes an offset range after a crash leaves the first
//! copy and moves on; an object is visible complete or not at all. The compact lock also replaces an
//! object only if it is unchanged ([`PutMode::Update`]). Both stores do both in `object_store` 0.13, with
//! `If-None-Match: *` / `If-Match: <etag>` (tested against moto and Azurite).
//!
//! Settings come from the environment, as the `object_store` builders read them
//! (`*Builder::from_env`):
//! - S3: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT` (an S3-compatible
//!   server), `AWS_ALLOW_HTTP` (`true` for a plain-HTTP endpoint), …
//! - Azure: `AZURE_STORAGE_ACCOUNT_NAME` with `AZURE_STORAGE_ACCOUNT_KEY` (or `AZURE_STORAGE_SAS_KEY`,
//!   `AZURE_STORAGE_CLIENT_ID`/`_CLIENT_SECRET`/`_TENANT_ID`, managed identity, …), `AZURE_STORAGE_ENDPOINT`;
//!   for the Azurite emulator `AZURE_STORAGE_USE_EMULATOR=true` (account `devstoreaccount1` and its
//!   public key) with `AZURITE_BLOB_STORAGE_URL` (default `http://127.0.0.1:10000`).
//!
//! Stage state (the vote cache, progress files: not tables) stays on local disk: under
//! `$NEXTSTATE_STATE_DIR`, default `.nextstate-state/<bucket>/<prefix>/`.
//!
//! Beside the tables, the lake's prefix holds two folders that are not tables (a leading `_`, so
//! [`super::Lake::tables`] and `nextstate sql` skip them):
//! - `_state/compact/<table>.lock`: the lock object of `nextstate compact` ([`super::compact`]), created
//!   with a conditional PUT so that compactors on different machines exclude each other;
//! - `_checkpoints/<run>/<version>/<file>`: the trainer's checkpoints, uploaded after they are complete
//!   locally, `manifest.json` last ([`crate::trainer::checkpoint`]). Not `checkpoints/`: that folder is
//!   the `checkpoints` table.
//!
//! Not done: `gs://`. `object_store`'s GCS client (feature `gcp`) writes through GCS's XML API
//! (`PUT /<bucket>/<object>` with `x-goog-if-generation-match`), which no local GCS emulator from the
//! package registries implements (fake-gcs-server answers that PUT `400 invalid uploadType`;
//! gcp-storage-emulator ignores the condition), so the exactly-once rule could not be tested on it.

use std::future::Future;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use datafusion::object_store::aws::AmazonS3Builder;
use datafusion::object_store::azure::MicrosoftAzureBuilder;
use datafusion::object_store::path::Path as ObjectPath;
use datafusion::object_store::{
    GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion, WriteMultipart,
};
use futures::{StreamExt, TryStreamExt};

use crate::error::{Error, Result};

/// The object store behind a lake, and where in it the lake lives.
#[derive(Debug)]
pub struct Remote {
    /// The store (S3 or Azure client).
    pub store: Arc<dyn ObjectStore>,
    /// `s3://bucket` or `az://container` (what DataFusion registers the store under).
    pub base: url::Url,
    /// The lake's prefix inside the bucket (may be empty).
    pub prefix: ObjectPath,
    /// Local folder for stage state.
    pub state: PathBuf,
}

/// Whether `root` names object storage (`scheme://…`) rather than a local folder.
pub fn is_url(root: &str) -> bool {
    root.split_once("://").is_some_and(|(scheme, _)| !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric()))
}

/// The runtime that runs object-store requests for the lake's synchronous API.
fn io_runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("lake-io")
            .enable_all()
            .build()
            .expect("start the lake's object-store I/O runtime")
    })
}

/// Runs `f` to completion on the lake's I/O runtime from synchronous code (also from inside another
/// tokio runtime: the calling thread waits, as it would on a local file read).
pub fn block_on<F>(f: F) -> F::Output
where
    F: Future + Send,
    F::Output: Send,
{
    std::thread::scope(|s| s.spawn(|| io_runtime().block_on(f)).join().expect("lake object-store I/O thread panicked"))
}

/// `path` as an object path, unencoded (a segment with a control character is percent-encoded instead).
pub fn raw_path(path: &str) -> ObjectPath {
    ObjectPath::parse(path).unwrap_or_else(|_| ObjectPath::from(path))
}

fn store_err(op: &str, e: impl std::fmt::Display) -> Error {
    Error::Unreachable(format!("object store: {op}: {e}"))
}

/// Files up to this size are uploaded with one conditional PUT ([`Remote::upload_file`]); larger ones
/// in parts (S3 takes at most 5 GB in one PUT, and the file need not sit in memory).
pub const SINGLE_PUT_BYTES: u64 = 256 << 20;
/// Part size of a multipart upload.
const PART_BYTES: usize = 32 << 20;

impl Remote {
    /// Connects to the lake at `url` (`s3://bucket[/prefix]`, `az://container[/prefix]`).
    ///
    /// # Errors
    /// [`Error::Config`] for another scheme or a malformed URL; [`Error::Unreachable`] when the client
    /// cannot be built from the environment.
    pub fn connect(url: &str) -> Result<Remote> {
        let parsed = url::Url::parse(url).map_err(|e| Error::Config(format!("--lake {url}: {e}")))?;
        let bucket = parsed.host_str().ok_or_else(|| Error::Config(format!("--lake {url}: no bucket")))?.to_string();
        let store: Arc<dyn ObjectStore> = match parsed.scheme() {
            "s3" | "s3a" => Arc::new(AmazonS3Builder::from_env().with_bucket_name(&bucket).build().map_err(|e| store_err("configure S3", e))?),
            "az" | "azure" => Arc::new(
                MicrosoftAzureBuilder::from_env().with_container_name(&bucket).build().map_err(|e| store_err("configure Azure Blob Storage", e))?,
            ),
            s => {
                return Err(Error::Config(format!(
                    "--lake {url}: object storage scheme {s}:// is not supported (this build supports s3:// (also S3-compatible servers \
                     through AWS_ENDPOINT) and az://container/prefix (Azure Blob Storage))"
                )))
            }
        };
        let prefix = raw_path(parsed.path().trim_matches('/'));
        let base = url::Url::parse(&format!("{}://{bucket}", parsed.scheme())).map_err(|e| Error::Config(format!("--lake {url}: {e}")))?;
        let state = match std::env::var_os("NEXTSTATE_STATE_DIR") {
            Some(d) => PathBuf::from(d),
            None => PathBuf::from(".nextstate-state").join(&bucket).join(prefix.as_ref()),
        };
        Ok(Remote { store, base, prefix, state })
    }

    /// The object path of `rel` (a `/`-separated path relative to the lake), kept as written: the
    /// lake's file names hold `~`, which `ObjectPath::from` would percent-encode.
    pub fn path(&self, rel: &str) -> ObjectPath {
        let p = self.prefix.as_ref();
        raw_path(&if p.is_empty() { rel.to_string() } else { format!("{p}/{rel}") })
    }

    /// `rel` of an object path (its path below the lake's prefix).
    pub fn rel<'a>(&self, path: &'a str) -> &'a str {
        let p = self.prefix.as_ref();
        if p.is_empty() {
            path
        } else {
            path.strip_prefix(p).map(|r| r.trim_start_matches('/')).unwrap_or(path)
        }
    }

    /// Every object below `rel/` (recursive).
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the listing fails.
    pub fn list(&self, rel: &str) -> Result<Vec<ObjectMeta>> {
        let prefix = self.path(rel);
        block_on(async { self.store.list(Some(&prefix)).try_collect::<Vec<_>>().await }).map_err(|e| store_err("list", e))
    }

    /// The names of the "folders" directly below the lake's prefix.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the listing fails.
    pub fn folders(&self) -> Result<Vec<String>> {
        let prefix = (!self.prefix.as_ref().is_empty()).then(|| self.prefix.clone());
        let r = block_on(async { self.store.list_with_delimiter(prefix.as_ref()).await }).map_err(|e| store_err("list", e))?;
        Ok(r.common_prefixes.iter().filter_map(|p| p.filename().map(str::to_string)).collect())
    }

    /// Writes `bytes` at `path` unless an object is already there (one conditional PUT). Returns
    /// whether this call wrote it.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the PUT fails for another reason.
    pub fn put_new(&self, path: &ObjectPath, bytes: Vec<u8>) -> Result<bool> {
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        match block_on(async { self.store.put_opts(path, PutPayload::from(bytes), opts).await }) {
            Ok(_) => Ok(true),
            Err(datafusion::object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(store_err("put", e)),
        }
    }

    /// The whole object at `path`.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the GET fails.
    pub fn get(&self, path: &ObjectPath) -> Result<Bytes> {
        block_on(async { self.store.get_opts(path, GetOptions::default()).await?.bytes().await }).map_err(|e| store_err(&format!("get {path}"), e))
    }

    /// Writes `bytes` at `path` under `mode` (a conditional PUT: [`PutMode::Create`] writes only when no
    /// object is there, [`PutMode::Update`] only when the object still has the given version). Returns
    /// the written object's version, or `None` when the condition did not hold.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the PUT fails for another reason.
    pub fn put_if(&self, path: &ObjectPath, bytes: Vec<u8>, mode: PutMode) -> Result<Option<UpdateVersion>> {
        let opts = PutOptions { mode, ..Default::default() };
        match block_on(async { self.store.put_opts(path, PutPayload::from(bytes), opts).await }) {
            Ok(r) => Ok(Some(UpdateVersion { e_tag: r.e_tag, version: r.version })),
            Err(datafusion::object_store::Error::AlreadyExists { .. } | datafusion::object_store::Error::Precondition { .. }) => Ok(None),
            Err(e) => Err(store_err(&format!("put {path}"), e)),
        }
    }

    /// The whole object at `path` with its version (for a later [`PutMode::Update`]), or `None` when
    /// there is no object.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the GET fails for another reason.
    pub fn get_versioned(&self, path: &ObjectPath) -> Result<Option<(Bytes, UpdateVersion)>> {
        let got = block_on(async {
            let r = self.store.get_opts(path, GetOptions::default()).await?;
            let version = UpdateVersion { e_tag: r.meta.e_tag.clone(), version: r.meta.version.clone() };
            Ok::<_, datafusion::object_store::Error>((r.bytes().await?, version))
        });
        match got {
            Ok(g) => Ok(Some(g)),
            Err(datafusion::object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err(&format!("get {path}"), e)),
        }
    }

    /// Whether an object is at `path`.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the HEAD fails for another reason than a missing object.
    pub fn exists(&self, path: &ObjectPath) -> Result<bool> {
        match block_on(async { self.store.head(path).await }) {
            Ok(_) => Ok(true),
            Err(datafusion::object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(store_err(&format!("head {path}"), e)),
        }
    }

    /// Deletes the object at `path`; a missing object is not an error.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the DELETE fails.
    pub fn delete(&self, path: &ObjectPath) -> Result<()> {
        match block_on(async { self.store.delete(path).await }) {
            Ok(()) | Err(datafusion::object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store_err(&format!("delete {path}"), e)),
        }
    }

    /// Uploads the local file `local` to `path` unless an object is already there. A file up to
    /// [`SINGLE_PUT_BYTES`] is one conditional PUT; a larger one is streamed in parts (a multipart
    /// upload cannot be conditional: the object is checked for first, and it appears whole when the
    /// upload completes). Returns whether this call wrote it.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; [`Error::Unreachable`] when the upload fails.
    pub fn upload_file(&self, local: &Path, path: &ObjectPath) -> Result<bool> {
        let len = std::fs::metadata(local).map_err(|e| Error::io("stat", local, e))?.len();
        if len <= SINGLE_PUT_BYTES {
            let bytes = std::fs::read(local).map_err(|e| Error::io("read", local, e))?;
            return self.put_new(path, bytes);
        }
        if self.exists(path)? {
            return Ok(false);
        }
        let mut file = std::fs::File::open(local).map_err(|e| Error::io("open", local, e))?;
        block_on(async {
            let upload = self.store.put_multipart(path).await.map_err(|e| store_err(&format!("start upload {path}"), e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
            let mut buf = vec![0u8; PART_BYTES];
            loop {
                let n = file.read(&mut buf).map_err(|e| Error::io("read", local, e))?;
                if n == 0 {
                    break;
                }
                // at most two parts in flight: bounded memory for any file size
                w.wait_for_capacity(2).await.map_err(|e| store_err(&format!("upload {path}"), e))?;
                w.write(&buf[..n]);
            }
            w.finish().await.map_err(|e| store_err(&format!("upload {path}"), e))
        })?;
        Ok(true)
    }

    /// Downloads the object at `path` into the local file `local` (created or truncated, fsynced),
    /// streaming it.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the GET fails (also for a missing object); [`Error::Io`] when the
    /// file cannot be written.
    pub fn download_file(&self, path: &ObjectPath, local: &Path) -> Result<()> {
        let mut file = std::fs::File::create(local).map_err(|e| Error::io("create", local, e))?;
        block_on(async {
            let r = self.store.get_opts(path, GetOptions::default()).await.map_err(|e| store_err(&format!("get {path}"), e))?;
            let mut chunks = r.into_stream();
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk.map_err(|e| store_err(&format!("get {path}"), e))?;
                file.write_all(&chunk).map_err(|e| Error::io("write", local, e))?;
            }
            Ok::<_, Error>(())
        })?;
        file.sync_all().map_err(|e| Error::io("fsync", local, e))
    }
}
