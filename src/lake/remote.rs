//! A lake on object storage: `--lake s3://bucket/prefix` (S3 and S3-compatible servers), through the
//! `object_store` crate that DataFusion already uses.
//!
//! The same layout as on a local disk (`<prefix>/<table>/date=YYYY-MM-DD/<name>.parquet`), the same
//! file names, the same exactly-once rule: a file is written with one PUT, conditional on the object not
//! existing (`If-None-Match: *`, [`PutMode::Create`]), so a sink that re-writes an offset range after a
//! crash leaves the first copy and moves on; an object is visible complete or not at all.
//!
//! Settings come from the environment, as the `object_store` builders read them: `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT` (an S3-compatible server), `AWS_ALLOW_HTTP`
//! (`true` for a plain-HTTP endpoint), … Stage state (the vote cache, progress files: not tables) stays
//! on local disk: under `$NEXTSTATE_STATE_DIR`, default `.nextstate-state/<bucket>/<prefix>/`.
//!
//! Not done: `gs://` and `az://` (the crate's `gcp`/`azure` features are not built), `nextstate compact`
//! on object storage (it refuses), trainer checkpoints (written to local `checkpoints/`).

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use datafusion::object_store::aws::AmazonS3Builder;
use datafusion::object_store::path::Path as ObjectPath;
use datafusion::object_store::{GetOptions, ObjectMeta, ObjectStore, PutMode, PutOptions, PutPayload};
use futures::TryStreamExt;

use crate::error::{Error, Result};

/// The object store behind a lake, and where in it the lake lives.
#[derive(Debug)]
pub struct Remote {
    /// The store (S3 client).
    pub store: Arc<dyn ObjectStore>,
    /// `s3://bucket` (what DataFusion registers the store under).
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

impl Remote {
    /// Connects to the lake at `url` (`s3://bucket[/prefix]`).
    ///
    /// # Errors
    /// [`Error::Config`] for a scheme other than `s3` or a malformed URL; [`Error::Unreachable`] when
    /// the client cannot be built from the environment.
    pub fn connect(url: &str) -> Result<Remote> {
        let parsed = url::Url::parse(url).map_err(|e| Error::Config(format!("--lake {url}: {e}")))?;
        let bucket = parsed.host_str().ok_or_else(|| Error::Config(format!("--lake {url}: no bucket")))?.to_string();
        let store: Arc<dyn ObjectStore> = match parsed.scheme() {
            "s3" | "s3a" => Arc::new(AmazonS3Builder::from_env().with_bucket_name(&bucket).build().map_err(|e| store_err("configure S3", e))?),
            s => {
                return Err(Error::Config(format!(
                    "--lake {url}: object storage scheme {s}:// is not supported (this build supports s3://, including S3-compatible servers through AWS_ENDPOINT)"
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
}
