//! Sharded checkpoints that load under any dp/tp layout, written crash-consistently, owned by
//! the run lineage that wrote them.
//!
//! A checkpoint is a folder `step-NNNNNNNN` holding one safetensors shard per rank that has
//! something to write, and a `manifest.json` listing every shard with its size and SHA-256, the
//! lineage ([`RunId`]) of the run that wrote it, the layout it was written under, every
//! parameter's full shape and split ([`ShardKind`](crate::tensor_parallel::ShardKind)), and
//! the caller's own state (config, data position, ...). Parameters are written by the ranks of
//! the first DP replica; AdamW moments by every rank that holds some (with ZeRO-1 each DP rank
//! holds its own part).
//!
//! Writing ([`save`]) is crash-consistent: the shards and the manifest go into a hidden partial
//! folder, files and folders are synced, the folder is renamed into place and only then does
//! the file `latest` in the checkpoint root switch to it (atomically); pruning then removes
//! only older checkpoints of the same lineage. [`fault`] names every step, so tests can kill a
//! save anywhere. An asynchronous save ([`start`], [`pending`]) writes each rank's files on a
//! writer thread while training goes on, and completes the same way later.
//!
//! Reading ([`Checkpoint::open`]) treats the manifest as untrusted: names must stay inside the
//! folder and every number must fit the files before anything is allocated from it; then every
//! shard's size and checksum is checked, every tensor put back together at full size, and
//! this rank's piece cut for the layout of the new run. Each rank reads every shard: simple,
//! and fine for the model sizes one host trains; a large multi-node run would read only the
//! shards that overlap its own.

#[cfg(test)]
mod crash_tests;
mod error;
pub mod fault;
mod manifest;
pub mod pending;
mod read;
#[cfg(test)]
pub(crate) use read::{COUNTING_OPTIMIZERS, NON_NEGATIVE_STATE};
#[cfg(test)]
mod read_tests;
pub mod root;
mod run_id;
pub mod shard_file;
mod slots;
pub mod state;
mod write;

use std::path::Path;

use sha2::{Digest, Sha256};

pub use error::{CheckpointError, few_names};
pub use manifest::{
    FORMAT, FileEntry, MAX_DEGREE, MAX_STEP, Manifest, ParamEntry, TRAINER_EXTRA_KEYS, check_model,
};
pub use pending::{PendingSave, Saved, start};
pub use read::{Checkpoint, FullState, LocalPieces, cut_full_params};
pub use run_id::RunId;
pub use shard_file::{NamedTensor, TensorRef};
pub use slots::{Slots, StateSlots};
pub use state::{LocalParam, Moments};
pub use write::{save, write_file_atomically};

/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";
/// The file in a checkpoint root naming the newest checkpoint folder.
pub const LATEST: &str = "latest";

/// Whether `name` is one plain file or folder name: no separator, not `.` or `..`, not
/// absolute, so that joining it to a folder stays inside that folder.
pub(crate) fn plain_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(n)), None) if n == name
    )
}

/// The most bytes a manifest may have (a model with a million parameter tensors needs about a
/// tenth of it).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 30;
/// The most bytes of a small text file of a checkpoint root or a run folder (`latest`,
/// `run.json`).
pub const MAX_SMALL_FILE_BYTES: u64 = 1 << 16;

/// Between a tensor's name and its first element in the name of a ZeRO piece
/// ([`TensorPiece`]): `m1/h.0.attn.weight@4096`.
pub(crate) const PIECE_MARK: &str = "@";

/// Reads `path`, which must be a regular file (a symbolic link to one is fine) of at most
/// `limit` bytes: a FIFO or a device would block or never end, and a huge file would fill
/// the memory, so both are refused naming the file before it is opened.
pub fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, CheckpointError> {
    let meta = std::fs::metadata(path).map_err(CheckpointError::io(path))?;
    let refuse = |reason: String| CheckpointError::Corrupt {
        file: path.to_path_buf(),
        reason,
    };
    if !meta.is_file() {
        return Err(refuse(
            "not a regular file (a folder, a FIFO or a device)".into(),
        ));
    }
    if meta.len() > limit {
        return Err(refuse(format!(
            "{} bytes, more than the {limit} such a file may have",
            meta.len()
        )));
    }
    std::fs::read(path).map_err(CheckpointError::io(path))
}

/// What a rank contributes to a checkpoint.
pub struct RankState {
    /// This rank's parameter shards (written by the first DP replica only; under ZeRO-3 their
    /// values are empty and `pieces` holds this rank's pieces).
    pub params: Vec<LocalParam>,
    /// This rank's optimizer moments of whole tensors, by parameter name.
    pub moments: state::NamedMoments,
    /// Under ZeRO: this data-parallel rank's pieces of the parameters (ZeRO-3) and of their
    /// moments, which every DP rank of the first copy writes (the checkpoint's DP-piece split).
    pub pieces: Vec<TensorPiece>,
}

/// A data-parallel rank's piece of one tensor of a checkpoint: elements
/// `start..start + values.len()` of a parameter's (`kind` "param"), first moment's ("m1") or
/// second moment's ("m2") row-major values on this tensor-parallel rank. Pieces of all DP
/// ranks together cover each tensor exactly once; reading a checkpoint puts them together.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPiece {
    /// "param", "m1" or "m2".
    pub kind: &'static str,
    /// The parameter's name.
    pub name: String,
    /// The first element.
    pub start: usize,
    /// The values.
    pub values: Vec<f32>,
    /// The optimizer's step count of the parameter (moments only; 0 for a parameter).
    pub time: usize,
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// The size and SHA-256 digest (lowercase hex) of the file at `path`, read in blocks.
fn sha256_file(path: &std::path::Path) -> Result<(u64, String), CheckpointError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(CheckpointError::io(path))?;
    let (mut hasher, mut block, mut size) = (Sha256::new(), vec![0u8; 1 << 20], 0u64);
    loop {
        let n = file.read(&mut block).map_err(CheckpointError::io(path))?;
        if n == 0 {
            return Ok((size, hex(&hasher.finalize())));
        }
        hasher.update(&block[..n]);
        size += n as u64;
    }
}

/// Bytes as lowercase hex.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The folder name of the checkpoint after `step` steps.
pub fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor_parallel::{Shard, ShardKind};
    use burn::module::ParamId;
    use state::ParamShape;
    use std::collections::HashMap;

    #[test]
    fn only_plain_names_stay_inside_a_folder() {
        for ok in ["params-tp00-pp00.safetensors", "step-00000005", "a..b"] {
            assert!(plain_name(ok), "{ok}");
        }
        for bad in [
            "../../x.safetensors",
            "..",
            ".",
            "",
            "/etc/passwd",
            "sub/x.safetensors",
            "./x",
        ] {
            assert!(!plain_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn full_params_are_cut_the_way_the_model_splits_them() {
        // tp rank 1 of 2: a padded vocabulary table, its tied copy, column and row splits.
        let vocab = ShardKind::VocabRows { vocab: 5 };
        let shard = Shard { rank: 1, size: 2 };
        let param = |name: &str, shape: Vec<usize>, split| ParamShape {
            name: name.to_string(),
            id: ParamId::new(),
            shape,
            split,
        };
        let shapes = vec![
            param("wte", vec![3, 2], vocab),
            param("head", vec![3, 2], vocab),
            param("qkv", vec![2, 3], ShardKind::Columns { segments: 3 }),
            param("proj", vec![2, 2], ShardKind::Rows),
            param("ln", vec![2], ShardKind::Replicated),
        ];
        let values = |n: usize| (0..n).map(|i| i as f32 + 1.0).collect::<Vec<f32>>();
        let mut full = HashMap::from([
            ("wte".to_string(), (vec![5, 2], values(10))),
            ("qkv".to_string(), (vec![2, 6], values(12))),
            ("proj".to_string(), (vec![4, 2], values(8))),
            ("ln".to_string(), (vec![2], values(2))),
            ("elsewhere".to_string(), (vec![7], values(7))),
        ]);
        let copies = [("head".to_string(), "wte".to_string())];
        let cut = cut_full_params(&full, &shapes, shard, &copies).unwrap();
        // Rows 3, 4 and a zero row of padding.
        assert_eq!(cut["wte"], vec![7.0, 8.0, 9.0, 10.0, 0.0, 0.0]);
        assert_eq!(cut["head"], cut["wte"]);
        // [q0 q1 | k0 k1 | v0 v1] per row: rank 1 holds q1 k1 v1.
        assert_eq!(cut["qkv"], vec![2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
        assert_eq!(cut["proj"], vec![5.0, 6.0, 7.0, 8.0]);
        assert_eq!(cut["ln"], vec![1.0, 2.0]);
        assert_eq!(cut.len(), 5, "parameters of other stages are skipped");

        full.get_mut("proj").unwrap().0 = vec![2, 4];
        let e = cut_full_params(&full, &shapes, shard, &copies).unwrap_err();
        assert!(e.to_string().contains("proj"), "{e}");
        full.get_mut("proj").unwrap().0 = vec![4, 2];
        full.remove("ln");
        let e = cut_full_params(&full, &shapes, shard, &copies).unwrap_err();
        assert!(e.to_string().contains("ln"), "{e}");
    }
}
