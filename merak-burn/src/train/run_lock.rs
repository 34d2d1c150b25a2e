//! A run folder belongs to one running run: the lock file `run.lock` in each folder a run
//! writes (its output folder and its checkpoint folder), taken before the run reads or
//! changes anything there, and held until the run ends.
//!
//! - **Who holds it.** The process that owns the run: `merak train --np N`'s launcher (across
//!   the whole job), rank 0 under a bare `mpirun`, the one process otherwise. A launcher hands
//!   its lock to the ranks it starts through [`LOCK_TOKEN_ENV`]; a process that already holds
//!   a folder's lock (a launcher's rank 0, or [`Trainer::fit`](super::Trainer::fit) inside
//!   `merak train`) joins it instead of taking it again.
//! - **How.** The lock file is locked with `flock(2)` (the kernel releases it when its holder
//!   ends, however it ends) and names its holder: host, boot, process id and start, since
//!   when, and the command. A second run finds the file locked and is refused naming the
//!   holder; of two runs started at the same instant, exactly one gets the file lock.
//! - **A holder that is gone.** A lock file left by a process that ended without removing it
//!   (killed, or its machine restarted) is taken over when the holder ran on this machine:
//!   the file lock proves it is gone. A lock file naming another host is refused, naming the
//!   file: only that host can tell whether its run still goes on (on a shared file system
//!   whose locks do not reach across hosts), so a person removes it.
//! - **File systems without `flock`.** The lock file alone decides there: a holder on this
//!   machine whose process is gone is taken over, a live one refuses; two runs started at the
//!   same instant may both start (logged once).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::checkpoint::RunId;
use crate::comm::{CommError, Communicator};

/// The lock file in a folder a run writes.
pub const LOCK_FILE: &str = "run.lock";
/// The environment variable through which a launcher hands its lock to the ranks it starts:
/// the token its lock file records.
pub const LOCK_TOKEN_ENV: &str = "MERAK_RUN_LOCK";
const LOCK_FORMAT: &str = "merak-lock/1";
/// The most bytes of a lock file read.
const MAX_LOCK_BYTES: u64 = 64 * 1024;
/// How long a run waits for a holder that has the file lock but has not written its name yet.
const NAME_WAIT: Duration = Duration::from_secs(2);
/// Attempts at locking a file that its holder removes meanwhile.
const ATTEMPTS: usize = 16;

/// The process that holds a run folder's lock, as its lock file records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holder {
    format: String,
    /// The host name.
    pub host: String,
    /// The kernel's boot id (Linux: `/proc/sys/kernel/random/boot_id`): equal ids mean the
    /// same machine since the same start.
    pub boot: Option<String>,
    /// The process id.
    pub pid: u32,
    /// The process's start time after boot, in clock ticks (Linux), which tells a reused
    /// process id from the holder.
    pub process_start: Option<u64>,
    /// When it took the lock (Unix seconds).
    pub since: u64,
    /// A random token; a launcher gives it to the ranks it starts ([`LOCK_TOKEN_ENV`]).
    pub token: String,
    /// Its command line.
    pub command: String,
}

impl Holder {
    /// This process, with `token`.
    fn this_process(token: String) -> Self {
        let pid = std::process::id();
        Self {
            format: LOCK_FORMAT.into(),
            host: host_name(),
            boot: boot_id(),
            pid,
            process_start: process_start(pid),
            since: now_secs(),
            token,
            command: std::env::args().collect::<Vec<_>>().join(" "),
        }
    }

    /// Whether `self` ran on the machine `me` runs on, since its last start: the file lock
    /// then tells whether it still holds the folder.
    fn same_machine(&self, me: &Holder) -> bool {
        match (&self.boot, &me.boot) {
            (Some(a), Some(b)) => a == b,
            _ => self.host == me.host,
        }
    }

    /// Whether `self` is the process `me`, or the launcher that started it.
    fn is_ours(&self, me: &Holder) -> bool {
        let launcher =
            std::env::var(LOCK_TOKEN_ENV).is_ok_and(|t| !t.is_empty() && t == self.token);
        let this = self.same_machine(me)
            && self.pid == me.pid
            && (self.process_start.is_none() || self.process_start == me.process_start);
        launcher || this
    }

    /// Whether the process still runs (this machine only; without `/proc`, assumed alive).
    fn alive(&self) -> bool {
        match (process_start(self.pid), self.process_start) {
            (Some(now), Some(then)) => now == then,
            (Some(_), None) => true,
            (None, _) => !Path::new("/proc/self").exists(),
        }
    }
}

impl std::fmt::Display for Holder {
    /// `pid 4242 on host node-1 since 2026-11-28 13:00:06 UTC (merak train --out run)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} on host {} since {} ({})",
            self.pid,
            self.host,
            super::run_folder::utc_time(self.since),
            self.command
        )
    }
}

/// Why a run may not take a folder's lock.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another running run holds the folder.
    #[error(
        "{folder} is in use by another run: {holder} holds its lock ({path}). Nothing was \
         changed: wait for that run to end or stop it, or choose another folder (--out, \
         checkpoint.dir)"
    )]
    Held {
        /// The folder.
        folder: PathBuf,
        /// Its lock file.
        path: PathBuf,
        /// Who holds it.
        holder: String,
    },
    /// The lock file names a process on another host, which this host cannot check.
    #[error(
        "{folder} is locked by a run on another host: {path} names {holder}, and this host \
         ({host}) cannot tell whether that run still goes on. Nothing was changed. If it has \
         ended, remove {path} and start again; otherwise choose another folder (--out, \
         checkpoint.dir)"
    )]
    OtherHost {
        /// The folder.
        folder: PathBuf,
        /// Its lock file.
        path: PathBuf,
        /// Who it names.
        holder: String,
        /// This host.
        host: String,
    },
    /// The folder holds a `run.lock` that is not a lock file merak wrote.
    #[error(
        "{path} is not a lock file merak wrote ({reason}). Nothing was changed: if no run \
         uses {folder}, remove {path} and start again"
    )]
    Unreadable {
        /// The folder.
        folder: PathBuf,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The lock file could not be made, read or written.
    #[error("cannot lock the run folder {folder}: {path}: {source}")]
    Io {
        /// The folder.
        folder: PathBuf,
        /// The file or folder the operation failed on.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// Rank 0 could not take the lock (on the other ranks; rank 0 reports the cause).
    #[error("rank 0 could not lock the run folder: {0}")]
    OnRankZero(String),
    /// Rank 0's answer did not arrive.
    #[error(transparent)]
    Comm(#[from] CommError),
}

/// A held run-folder lock: removed (and its file lock released) when dropped, if this
/// process took it; a lock this process joined (its launcher's, or its own taken elsewhere)
/// is left to its holder.
#[derive(Debug)]
pub struct RunLock {
    /// The lock file.
    path: PathBuf,
    /// The locked file, when this process took the lock.
    file: Option<File>,
    /// The token its record holds (for a launcher to hand to its ranks).
    token: String,
}

impl RunLock {
    /// Takes the lock of `folder` (made when missing), or joins it when this process or its
    /// launcher holds it; refuses when another run holds it.
    pub fn acquire(folder: &Path) -> Result<Self, LockError> {
        let io = |path: &Path| {
            let (folder, path) = (folder.to_path_buf(), path.to_path_buf());
            move |source| LockError::Io {
                folder,
                path,
                source,
            }
        };
        std::fs::create_dir_all(folder).map_err(io(folder))?;
        let path = folder.join(LOCK_FILE);
        let me = Holder::this_process(process_token().to_string());
        let at = Place {
            folder,
            path: &path,
        };
        for _ in 0..ATTEMPTS {
            let file = open_lock_file(&path).map_err(io(&path))?;
            match file.try_lock() {
                Ok(()) if !same_file(&file, &path) => continue,
                Ok(()) => return at.take(file, &me, true),
                Err(std::fs::TryLockError::WouldBlock) => return at.held(file, &me),
                Err(std::fs::TryLockError::Error(e)) if unsupported(&e) => {
                    return at.take(file, &me, false);
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(io(&path)(e)),
            }
        }
        Err(io(&path)(std::io::Error::other(
            "the lock file kept being replaced while this run tried to lock it",
        )))
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this process took the lock (and removes it when dropped).
    pub fn taken(&self) -> bool {
        self.file.is_some()
    }

    /// The token of the lock's record: a launcher hands it to the ranks it starts through
    /// [`LOCK_TOKEN_ENV`], so that they join the lock.
    pub fn token(&self) -> &str {
        &self.token
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if let Some(file) = self.file.take() {
            // Still our file (not replaced by a person meanwhile): removed while locked, so
            // that no one takes the lock of a file about to go.
            if same_file(&file, &self.path) {
                let _ = std::fs::remove_file(&self.path);
            }
            drop(file);
        }
    }
}

/// The locks of every folder a run writes, taken in order (a folder given twice is locked
/// once); released in reverse when dropped.
#[derive(Debug, Default)]
pub struct RunLocks(Vec<RunLock>);

impl RunLocks {
    /// Locks `folders` in order (see [`RunLock::acquire`]).
    pub fn acquire(folders: &[&Path]) -> Result<Self, LockError> {
        let mut locks = Self::default();
        let mut seen: Vec<&Path> = Vec::new();
        for folder in folders {
            if seen.contains(folder) {
                continue;
            }
            seen.push(folder);
            locks.0.push(RunLock::acquire(folder)?);
        }
        Ok(locks)
    }

    /// Rank 0 locks `folders` (the others wait for its answer): every rank gets `Ok` or an
    /// error, rank 0 the cause and the others [`LockError::OnRankZero`]. Only rank 0 holds
    /// the locks.
    pub fn on_rank_zero(world: &dyn Communicator, folders: &[&Path]) -> Result<Self, LockError> {
        if world.rank() != 0 {
            let answer = world.broadcast_text("", ANSWER_BYTES, 0)?;
            return match answer.strip_prefix("ok") {
                Some("") => Ok(Self::default()),
                _ => Err(LockError::OnRankZero(answer)),
            };
        }
        let locks = Self::acquire(folders);
        let answer = match &locks {
            Ok(_) => "ok".to_string(),
            Err(e) => e.to_string(),
        };
        world.broadcast_text(&answer, ANSWER_BYTES, 0)?;
        locks
    }

    /// The token of the locks this process took or joined ([`RunLock::token`]): one per
    /// process, shared by all its locks.
    pub fn token(&self) -> Option<&str> {
        self.0.first().map(RunLock::token)
    }

    /// The lock files this process took.
    pub fn taken(&self) -> Vec<&Path> {
        self.0
            .iter()
            .filter(|l| l.taken())
            .map(RunLock::path)
            .collect()
    }
}

impl Drop for RunLocks {
    fn drop(&mut self) {
        while let Some(lock) = self.0.pop() {
            drop(lock);
        }
    }
}

/// The most bytes of rank 0's answer to the others.
const ANSWER_BYTES: usize = 4096;

/// A folder and its lock file, for the decisions of [`RunLock::acquire`].
struct Place<'a> {
    folder: &'a Path,
    path: &'a Path,
}

impl Place<'_> {
    fn io(&self, source: std::io::Error) -> LockError {
        LockError::Io {
            folder: self.folder.to_path_buf(),
            path: self.path.to_path_buf(),
            source,
        }
    }

    /// `file` is not locked by anyone else (`flocked`), or cannot be (`!flocked`: the file
    /// system has no `flock`): takes it unless its record names a live holder.
    fn take(&self, mut file: File, me: &Holder, flocked: bool) -> Result<RunLock, LockError> {
        let text = read_text(&mut file).map_err(|e| self.io(e))?;
        if !text.trim().is_empty() {
            let holder = self.parse(&text)?;
            if !flocked && holder.is_ours(me) {
                return Ok(self.joined(&holder.token));
            }
            self.check_gone(&holder, me, flocked)?;
            tracing::warn!(
                "{}: taking over the lock of {holder}, which has ended",
                self.path.display()
            );
        } else if !flocked {
            tracing::warn!(
                "{}: the file system does not support file locks (flock); the lock file \
                 alone keeps a second run out, and two runs started at the same instant could \
                 both start",
                self.path.display()
            );
        }
        let written = write_holder(&mut file, me);
        if let Err(e) = written {
            if same_file(&file, self.path) {
                let _ = std::fs::remove_file(self.path);
            }
            return Err(self.io(e));
        }
        Ok(RunLock {
            path: self.path.to_path_buf(),
            file: Some(file),
            token: me.token.clone(),
        })
    }

    /// Refuses a holder that may still run: one on another host, or (without `flock`) a live
    /// process of this machine.
    fn check_gone(&self, holder: &Holder, me: &Holder, flocked: bool) -> Result<(), LockError> {
        let here = holder.same_machine(me) || holder.host == me.host;
        if !here {
            return Err(LockError::OtherHost {
                folder: self.folder.to_path_buf(),
                path: self.path.to_path_buf(),
                holder: holder.to_string(),
                host: me.host.clone(),
            });
        }
        // Same machine since its start: the file lock decides (we have it), or without one
        // whether the process runs. Same host name after a restart: gone.
        if !flocked && holder.same_machine(me) && holder.alive() {
            return Err(self.held_by(holder.to_string()));
        }
        Ok(())
    }

    /// Another process has the file lock: this process joins it when it is its own or its
    /// launcher's, otherwise refuses naming the holder.
    fn held(&self, mut file: File, me: &Holder) -> Result<RunLock, LockError> {
        let start = std::time::Instant::now();
        let text = loop {
            let text = read_text(&mut file).map_err(|e| self.io(e))?;
            if !text.trim().is_empty() || start.elapsed() >= NAME_WAIT {
                break text;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if text.trim().is_empty() {
            return Err(self.held_by("a process that has not written its name yet".into()));
        }
        match serde_json::from_str::<Holder>(&text) {
            Ok(h) if h.is_ours(me) => Ok(self.joined(&h.token)),
            Ok(h) => Err(self.held_by(h.to_string())),
            Err(_) => Err(self.held_by("a process (its lock file is unreadable)".into())),
        }
    }

    fn joined(&self, token: &str) -> RunLock {
        RunLock {
            path: self.path.to_path_buf(),
            file: None,
            token: token.to_string(),
        }
    }

    fn held_by(&self, holder: String) -> LockError {
        LockError::Held {
            folder: self.folder.to_path_buf(),
            path: self.path.to_path_buf(),
            holder,
        }
    }

    fn parse(&self, text: &str) -> Result<Holder, LockError> {
        let unreadable = |reason: String| LockError::Unreadable {
            folder: self.folder.to_path_buf(),
            path: self.path.to_path_buf(),
            reason,
        };
        let holder: Holder = serde_json::from_str(text).map_err(|e| unreadable(e.to_string()))?;
        if holder.format != LOCK_FORMAT {
            return Err(unreadable(format!("format {:?}", holder.format)));
        }
        Ok(holder)
    }
}

/// Opens (or makes) the lock file for reading and writing; a link there is refused (the
/// lock file is merak's own, never someone else's file it points to).
fn open_lock_file(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Whether `path` still names the file `file` is open on.
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), path.symlink_metadata()) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Whether a file-lock error says that the file system has no `flock`.
fn unsupported(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::Unsupported
        || matches!(
            e.raw_os_error(),
            Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS)
        )
}

fn read_text(file: &mut File) -> std::io::Result<String> {
    file.seek(SeekFrom::Start(0))?;
    let mut bytes = Vec::new();
    file.take(MAX_LOCK_BYTES).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Replaces the file's contents with `holder`'s record, flushed to disk.
fn write_holder(file: &mut File, holder: &Holder) -> std::io::Result<()> {
    let text = serde_json::to_vec_pretty(holder).map_err(std::io::Error::other)?;
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    file.write_all(&text)?;
    file.sync_all()
}

/// The token of this process's locks: its launcher's ([`LOCK_TOKEN_ENV`]), or one made once
/// for the process (every lock it takes has the same, which its launcher hands on).
fn process_token() -> &'static str {
    static TOKEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TOKEN.get_or_init(|| {
        std::env::var(LOCK_TOKEN_ENV)
            .ok()
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| RunId::new().to_string())
    })
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else `HOSTNAME`).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(id.trim().to_string()).filter(|s| !s.is_empty())
}

/// Field 22 of `/proc/<pid>/stat`: the process's start time after boot (clock ticks).
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
#[path = "run_lock_tests.rs"]
mod tests;
