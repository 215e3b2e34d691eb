//! The environment launcher: `PINDOWN_RANK`, `PINDOWN_SIZE`, and a
//! key-value space in the directory `PINDOWN_KV_DIR`.
//!
//! Rank `r`'s value of key `k` is the file `v.r.k`; fence number `n` of
//! rank `r` is the marker file `f.n.r`, written after all of `r`'s values.
//! Each file is written under a temporary name and renamed into place,
//! so a reader sees a whole file or none. A fence waits until every
//! rank's marker of that fence exists (polling, at most
//! `PINDOWN_LAUNCH_TIMEOUT`). The directory must be new (or empty) for
//! each job: a rank that finds its own first marker already there stops
//! with an error instead of taking an earlier job's files for its peers'.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{check_rank, number, text, LaunchError, Variables, MAX_VALUE_LEN};

/// The key-value space of the environment launcher.
pub(crate) struct DirectorySpace {
    dir: PathBuf,
    rank: u32,
    size: u32,
    fences: u64,
    timeout: Duration,
}

impl DirectorySpace {
    /// Joins through the `PINDOWN_*` variables; `None` if none is set.
    pub(crate) fn join(
        vars: &dyn Variables,
        timeout: Duration,
    ) -> Result<Option<(DirectorySpace, u32, u32)>, LaunchError> {
        let rank = number(vars, "PINDOWN_RANK")?;
        let size = number(vars, "PINDOWN_SIZE")?;
        let dir = text(vars, "PINDOWN_KV_DIR")?;
        let (rank, size) = match (rank, size, &dir) {
            (None, None, None) => return Ok(None),
            (Some(rank), Some(size), _) => (rank, size),
            (None, _, _) => {
                return Err(LaunchError::Variable {
                    variable: "PINDOWN_RANK".into(),
                    reason: "not set, but PINDOWN_SIZE or PINDOWN_KV_DIR is".into(),
                })
            }
            (Some(_), None, _) => {
                return Err(LaunchError::Variable {
                    variable: "PINDOWN_SIZE".into(),
                    reason: "not set, but PINDOWN_RANK is".into(),
                })
            }
        };
        check_rank(rank, size, "PINDOWN_RANK", "PINDOWN_SIZE")?;
        let dir = match dir {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => {
                return Err(LaunchError::Variable {
                    variable: "PINDOWN_KV_DIR".into(),
                    reason: "not set (or empty): ranks started through PINDOWN_RANK and \
                             PINDOWN_SIZE exchange addresses through files in this directory"
                        .into(),
                })
            }
        };
        std::fs::create_dir_all(&dir).map_err(|e| LaunchError::Directory {
            path: dir.clone(),
            reason: format!("cannot create it: {e}"),
        })?;
        let space = DirectorySpace {
            dir,
            rank,
            size,
            fences: 0,
            timeout,
        };
        let first_marker = space.marker(1, rank);
        if first_marker.exists() {
            return Err(LaunchError::Directory {
                path: first_marker,
                reason: format!(
                    "rank {rank}'s first fence marker is already there: the directory holds an \
                     earlier job's files (give each job a new PINDOWN_KV_DIR)"
                ),
            });
        }
        Ok(Some((space, rank, size)))
    }

    fn value_path(&self, rank: u32, key: &str) -> PathBuf {
        self.dir.join(format!("v.{rank}.{key}"))
    }

    fn marker(&self, fence: u64, rank: u32) -> PathBuf {
        self.dir.join(format!("f.{fence}.{rank}"))
    }

    /// Writes `bytes` to `path` through a temporary file and a rename.
    fn write_atomically(&self, path: &Path, bytes: &[u8]) -> Result<(), LaunchError> {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let temporary = self
            .dir
            .join(format!(".tmp.{}.{}.{name}", self.rank, std::process::id()));
        std::fs::write(&temporary, bytes)
            .and_then(|()| std::fs::rename(&temporary, path))
            .map_err(|e| {
                std::fs::remove_file(&temporary).ok();
                LaunchError::Directory {
                    path: path.into(),
                    reason: format!("cannot write it: {e}"),
                }
            })
    }

    /// Publishes this rank's `value` under `key` (checked by the caller:
    /// no path separators).
    pub(crate) fn put(&mut self, key: &str, value: &[u8]) -> Result<(), LaunchError> {
        self.write_atomically(&self.value_path(self.rank, key), value)
    }

    /// Writes this rank's next marker and waits for every rank's.
    pub(crate) fn fence(&mut self) -> Result<(), LaunchError> {
        self.fences += 1;
        let fence = self.fences;
        self.write_atomically(&self.marker(fence, self.rank), b"")?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(200);
        let mut waiting: Vec<u32> = (0..self.size).collect();
        loop {
            waiting.retain(|&rank| !self.marker(fence, rank).exists());
            if waiting.is_empty() {
                return Ok(());
            }
            if start.elapsed() >= self.timeout {
                let shown: Vec<String> = waiting.iter().take(16).map(u32::to_string).collect();
                return Err(LaunchError::Timeout {
                    what: format!(
                        "fence {fence} in {}: rank(s) {}{} never arrived",
                        self.dir.display(),
                        shown.join(", "),
                        if waiting.len() > 16 { ", ..." } else { "" }
                    ),
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// The value `rank` published under `key`.
    pub(crate) fn get(&mut self, rank: u32, key: &str) -> Result<Vec<u8>, LaunchError> {
        let path = self.value_path(rank, key);
        // Read at most one byte more than a value may hold.
        let read = std::fs::File::open(&path).and_then(|file| {
            let mut bytes = Vec::new();
            file.take(MAX_VALUE_LEN as u64 + 1)
                .read_to_end(&mut bytes)?;
            Ok(bytes)
        });
        match read {
            Ok(bytes) if bytes.len() > MAX_VALUE_LEN => Err(LaunchError::Malformed {
                rank,
                key: key.into(),
                reason: format!("{} is longer than {MAX_VALUE_LEN} bytes", path.display()),
            }),
            Ok(bytes) => Ok(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(LaunchError::NotFound {
                rank,
                key: key.into(),
                detail: format!(": no file {}", path.display()),
            }),
            Err(e) => Err(LaunchError::Directory {
                path,
                reason: format!("cannot read it: {e}"),
            }),
        }
    }
}
