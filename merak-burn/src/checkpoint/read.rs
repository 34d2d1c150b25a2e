//! Reading a checkpoint: the manifest checked before anything is built from it, every
//! shard's size and checksum verified, every tensor put back together at full size and cut
//! again for the layout of the run that loads it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use super::root::{list, read_checked_manifest};
use super::state::ParamShape;
use super::{
    CheckpointError, LATEST, MANIFEST, Manifest, Moments, PIECE_MARK, ParamEntry, plain_name,
    read_regular, sha256_hex, shard_file,
};
use crate::tensor_parallel::{Shard, ShardKind};

/// A checkpoint on disk whose manifest has been read.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The checkpoint folder.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

/// A rank's pieces of a checkpoint: parameters and AdamW moments by the model's names.
pub type LocalPieces = (HashMap<String, Vec<f32>>, HashMap<String, Moments>);

/// Every tensor of a checkpoint at full size.
#[derive(Clone, Debug, Default)]
pub struct FullState {
    /// Parameters by name.
    pub params: HashMap<String, Vec<f32>>,
    /// AdamW moments by name (absent for parameters never stepped).
    pub moments: HashMap<String, Moments>,
}

impl Checkpoint {
    /// Opens the checkpoint at `path`: a `step-*` folder, or a checkpoint root, whose newest
    /// complete checkpoint it opens (the one `latest` names, or a newer complete one that a
    /// job killed before switching `latest` left). The manifest is checked
    /// ([`Manifest::validate`]) and every shard's size compared before anything is read.
    pub fn open(path: &Path) -> Result<Checkpoint, CheckpointError> {
        let dir = if path.join(MANIFEST).exists() {
            path.to_path_buf()
        } else {
            resolve_root(path)?
        };
        let manifest_path = dir.join(MANIFEST);
        let manifest = read_checked_manifest(&dir)?;
        manifest.validate(&manifest_path)?;
        let ckpt = Checkpoint { dir, manifest };
        // Cheap checks first, so a damaged checkpoint is reported before anything is built.
        for f in &ckpt.manifest.files {
            let path = ckpt.dir.join(&f.file);
            let meta = std::fs::metadata(&path)
                .map_err(|_| CheckpointError::MissingShard { file: path.clone() })?;
            if !meta.is_file() {
                return Err(CheckpointError::Corrupt {
                    file: path,
                    reason: "not a regular file".into(),
                });
            }
            if meta.len() != f.bytes {
                return Err(CheckpointError::Truncated {
                    file: path,
                    expected: f.bytes,
                    got: meta.len(),
                });
            }
        }
        Ok(ckpt)
    }

    /// Reads and verifies every shard and puts every tensor back together at full size.
    /// Every tensor must be one the manifest lists (`param/`, `m1/` or `m2/` of a listed
    /// parameter) with the shape its parameter's shape and split give, every value must be
    /// finite (a checkpoint of a diverged run is refused, naming the file and the tensor), and
    /// the optimizer state must be one a run can reach (what the manifest's optimizer keeps in
    /// each state tensor at the checkpoint's step; centred RMSprop's squared-gradient average
    /// at least the square of its gradient average).
    pub fn read_full(&self) -> Result<FullState, CheckpointError> {
        let m = &self.manifest;
        let mut read = ReadPieces::new(m);
        for f in &m.files {
            let path = self.dir.join(&f.file);
            let bytes = self.read_shard(f)?;
            let (tensors, meta) = shard_file::decode(&bytes, &path)?;
            read.add_counts(&meta, &path)?;
            for t in tensors {
                read.add(t, f.tp, &path)?;
            }
        }
        let ReadPieces {
            mut pieces,
            zero_pieces,
            times,
            entries,
            rules,
            ..
        } = read;
        for ((kind, name, tp), parts) in zero_pieces {
            let len = (entries.get(name.as_str()))
                .and_then(|e| e.shard.piece_len(&e.shape, m.layout.tp).ok())
                .unwrap_or(0);
            let values = join_pieces(parts, len).map_err(|reason| CheckpointError::Mismatch {
                name: name.clone(),
                reason: format!("{kind} of tp rank {tp}: {reason}"),
            })?;
            pieces.insert((kind, name, tp), values);
        }
        let mut full = FullState::default();
        for p in &m.params {
            full.params
                .insert(p.name.clone(), merge(&mut pieces, p, "param", m.layout.tp)?);
            let has_moments = (0..m.layout.tp)
                .any(|r| pieces.contains_key(&("m1".to_string(), p.name.clone(), r)));
            if has_moments {
                let moments = Moments {
                    time: rules.count_of(&p.name, &times)?,
                    m1: merge(&mut pieces, p, "m1", m.layout.tp)?,
                    m2: merge(&mut pieces, p, "m2", m.layout.tp)?,
                };
                full.moments.insert(p.name.clone(), moments);
            }
        }
        check_centered(&full, m, &self.dir)?;
        Ok(full)
    }

    /// The bytes of shard `f`, checked against the manifest's size and SHA-256.
    fn read_shard(&self, f: &super::FileEntry) -> Result<Vec<u8>, CheckpointError> {
        let path = self.dir.join(&f.file);
        let bytes = read_regular(&path, f.bytes)?;
        if bytes.len() as u64 != f.bytes {
            return Err(CheckpointError::Truncated {
                file: path,
                expected: f.bytes,
                got: bytes.len() as u64,
            });
        }
        let sum = sha256_hex(&bytes);
        if sum != f.sha256 {
            return Err(CheckpointError::Checksum {
                file: path,
                expected: f.sha256.clone(),
                got: sum,
            });
        }
        Ok(bytes)
    }
}

/// The newest complete checkpoint of the checkpoint root `root` (see [`Checkpoint::open`]).
fn resolve_root(root: &Path) -> Result<PathBuf, CheckpointError> {
    if !root.is_dir() {
        return Err(CheckpointError::Io {
            path: root.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such folder"),
        });
    }
    let listing = list(root)?;
    if let Some(name) = listing.latest.as_deref().filter(|n| !plain_name(n)) {
        return Err(CheckpointError::BadManifest {
            path: root.join(LATEST),
            reason: format!("names {name:?}, not a checkpoint folder beside it"),
        });
    }
    if let Some(dir) = listing.newest(root) {
        return Ok(dir);
    }
    if listing.is_empty() {
        return Err(CheckpointError::MissingManifest {
            dir: root.to_path_buf(),
        });
    }
    let reason = match (listing.unreadable.first(), listing.unfinished.first()) {
        (Some(dir), _) => format!("{} has no readable manifest.json", dir.display()),
        (None, Some(dir)) => format!(
            "{} is a save that was interrupted before it completed",
            dir.display()
        ),
        (None, None) => match listing.branches.first() {
            Some(b) => format!(
                "only branches set aside: resume one of them, such as {}",
                b.display()
            ),
            None => "nothing but a `latest` naming a folder that is not here".into(),
        },
    };
    Err(CheckpointError::NoCheckpoint {
        root: root.to_path_buf(),
        reason,
    })
}

/// Tensor pieces by (kind: param, m1 or m2; parameter name; tp rank).
type Pieces = HashMap<(String, String, usize), Vec<f32>>;

/// ZeRO pieces of the tensors, as `(first element, values)` (keyed as [`Pieces`]).
type ZeroPieces = HashMap<(String, String, usize), Vec<(usize, Vec<f32>)>>;

/// Takes the `tp` pieces of `kind` of parameter `p` out of `pieces` and puts them together.
fn merge(
    pieces: &mut Pieces,
    p: &ParamEntry,
    kind: &str,
    tp: usize,
) -> Result<Vec<f32>, CheckpointError> {
    let what = match kind {
        "param" => "the parameter",
        "m1" => "the first moment",
        _ => "the second moment",
    };
    // A replicated parameter is whole on every TP rank: rank 0's copy is the parameter.
    let ranks = match p.shard {
        ShardKind::Replicated => 1,
        _ => tp,
    };
    let parts = (0..ranks)
        .map(|r| {
            pieces
                .remove(&(kind.to_string(), p.name.clone(), r))
                .ok_or_else(|| CheckpointError::Mismatch {
                    name: p.name.clone(),
                    reason: format!("{what} of tp rank {r} is missing from the shards"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(p.shard.merge(&parts, &p.shape))
}

/// The TP rank whose piece of parameter `entry` a ZeRO piece written by TP rank `tp` belongs
/// to: its own, but a routed expert's (whole on every TP rank) pieces are cut over the ranks
/// holding the same experts, TP ranks included, so they join into one piece (rank 0's).
fn piece_tp(entry: &ParamEntry, tp: usize) -> usize {
    match entry.shard == ShardKind::Replicated && crate::moe::is_expert_param(&entry.name) {
        true => 0,
        false => tp,
    }
}

/// The first element of a ZeRO piece written `start` (the text after [`PIECE_MARK`]) of `len`
/// values, in a tensor of `whole` values; fails naming the tensor and the file.
fn piece_start(
    start: &str,
    len: usize,
    whole: Option<&usize>,
    tensor: &str,
    file: &Path,
) -> Result<usize, CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        file: file.to_path_buf(),
        reason: format!("ZeRO piece {tensor}: {reason}"),
    };
    let at: usize = start
        .parse()
        .map_err(|_| corrupt(format!("{start:?} is not an element index")))?;
    match whole {
        Some(&n) if at.checked_add(len).is_some_and(|end| end <= n) => Ok(at),
        Some(n) => Err(corrupt(format!(
            "elements {at}.. ({len} values) run past the tensor's {n}"
        ))),
        None => Err(corrupt("its parameter's shape does not split".into())),
    }
}

/// The `len` values that `parts` (`(first element, values)`, from every data-parallel rank)
/// cover exactly once; says where they leave a gap or overlap.
fn join_pieces(mut parts: Vec<(usize, Vec<f32>)>, len: usize) -> Result<Vec<f32>, String> {
    parts.sort_by_key(|(at, _)| *at);
    let mut values = Vec::with_capacity(len);
    for (at, part) in parts {
        if at != values.len() {
            let what = if at < values.len() {
                "overlap"
            } else {
                "leave a gap"
            };
            return Err(format!(
                "the ZeRO pieces {what} at element {}",
                values.len().min(at)
            ));
        }
        values.extend(part);
    }
    if values.len() != len {
        return Err(format!(
            "the ZeRO pieces end at element {} of {len}",
            values.len()
        ));
    }
    Ok(values)
}

/// The tensors of a checkpoint's shards as they are read: whole pieces, ZeRO pieces and the
/// optimizer's step counts, with what the manifest says they must be.
struct ReadPieces<'m> {
    pieces: Pieces,
    zero_pieces: ZeroPieces,
    times: HashMap<String, usize>,
    /// The manifest's parameters by name.
    entries: HashMap<&'m str, &'m ParamEntry>,
    /// The tp degree the checkpoint was written at.
    degree: usize,
    /// What its optimizer state must satisfy.
    rules: StateRules,
}

impl<'m> ReadPieces<'m> {
    /// Nothing read yet of the checkpoint whose manifest is `m`.
    fn new(m: &'m Manifest) -> Self {
        ReadPieces {
            pieces: Pieces::new(),
            zero_pieces: ZeroPieces::new(),
            times: HashMap::new(),
            entries: m.params.iter().map(|p| (p.name.as_str(), p)).collect(),
            degree: m.layout.tp,
            rules: StateRules::of(m),
        }
    }

    /// Takes tensor `t` of the shard `file` written by tp rank `tp`. A tensor that is not one
    /// merak writes, whose shape or size disagrees with its parameter's, or whose values no
    /// run writes ([`StateRules::check_values`]) is refused naming the file and the tensor.
    fn add(
        &mut self,
        t: shard_file::NamedTensor,
        tp: usize,
        file: &Path,
    ) -> Result<(), CheckpointError> {
        let (degree, corrupt) = (self.degree, |reason: String| CheckpointError::Corrupt {
            file: file.to_path_buf(),
            reason: format!("tensor {}: {reason}", t.name),
        });
        let (kind, rest) = t.name.split_once('/').unwrap_or(("", &t.name));
        let (name, start) = match rest.split_once(PIECE_MARK) {
            Some((name, start)) => (name, Some(start)),
            None => (rest, None),
        };
        let entry = match (kind, self.entries.get(name)) {
            ("param" | "m1" | "m2", Some(entry)) => *entry,
            ("param" | "m1" | "m2", None) => {
                return Err(corrupt(format!("the manifest lists no parameter {name}")));
            }
            _ => {
                return Err(corrupt(
                    "not a tensor merak writes (param/, m1/ or m2/ and a parameter's name)".into(),
                ));
            }
        };
        self.rules.check_values(&t.name, kind, &t.values, file)?;
        let want = entry.shard.piece_len(&entry.shape, degree);
        if let Some(start) = start {
            if t.shape != [t.values.len()] {
                return Err(corrupt(format!(
                    "shape {:?}; a ZeRO piece is a list of values",
                    t.shape
                )));
            }
            let at = piece_start(start, t.values.len(), want.as_ref().ok(), &t.name, file)?;
            let key = (kind.to_string(), name.to_string(), piece_tp(entry, tp));
            self.zero_pieces
                .entry(key)
                .or_default()
                .push((at, t.values));
            return Ok(());
        }
        if want.as_ref().ok() != Some(&t.values.len()) {
            return Err(corrupt(format!(
                "{} values, its shape {:?} split over tp = {degree} gives {want:?}",
                t.values.len(),
                entry.shape,
            )));
        }
        let full = entry.shard.full_shape(&t.shape, degree);
        if full != entry.shape {
            return Err(corrupt(format!(
                "shape {:?} (a full shape of {full:?} over tp = {degree}), the manifest says {:?}",
                t.shape, entry.shape
            )));
        }
        let key = (kind.to_string(), name.to_string(), tp);
        self.pieces.insert(key, t.values);
        Ok(())
    }

    /// Takes the optimizer's step counts that the metadata `meta` of the shard `file` holds
    /// (see [`StateRules::step_counts`]).
    fn add_counts(
        &mut self,
        meta: &HashMap<String, String>,
        file: &Path,
    ) -> Result<(), CheckpointError> {
        let counts = self.rules.step_counts(meta, &self.entries, file)?;
        self.times.extend(counts);
        Ok(())
    }
}

/// The shard metadata key holding the optimizer's step count of each parameter.
const STEP_COUNTS: &str = "adamw_time";

/// What each kind of optimizer state (`extra.optimizer.state`) must satisfy: the tensors
/// that sum or average squares are never negative.
pub(crate) const NON_NEGATIVE_STATE: [&str; 3] = [
    "second moment",
    "sum of squared gradients",
    "squared-gradient average",
];

/// The optimizers that count their steps per parameter (a parameter with state has taken at
/// least one; Adam's bias correction divides by zero at none).
pub(crate) const COUNTING_OPTIMIZERS: [&str; 3] = ["adamw", "adam", "adagrad"];

/// What a checkpoint's optimizer state must satisfy, from its manifest: the optimizer that
/// wrote it, what each of its two state tensors holds, and the checkpoint's step.
struct StateRules {
    /// The optimizer (`extra.optimizer.kind`; AdamW when absent).
    kind: String,
    /// What `m1` and `m2` hold (`extra.optimizer.state`).
    slots: Vec<String>,
    /// The checkpoint's step.
    step: usize,
}

impl StateRules {
    /// The rules of the checkpoint whose manifest is `m`.
    fn of(m: &Manifest) -> Self {
        let (kind, slots) = m.stored_optimizer();
        StateRules {
            kind,
            slots,
            step: m.step,
        }
    }

    /// The step count of the parameter `name` among `times` (the shards'); a parameter with
    /// state but no count is refused for an optimizer that counts ([`COUNTING_OPTIMIZERS`]).
    fn count_of(
        &self,
        name: &str,
        times: &HashMap<String, usize>,
    ) -> Result<usize, CheckpointError> {
        match times.get(name) {
            Some(t) => Ok(*t),
            None if COUNTING_OPTIMIZERS.contains(&self.kind.as_str()) => {
                Err(CheckpointError::Mismatch {
                    name: name.to_string(),
                    reason: format!(
                        "its {} state has no step count ({STEP_COUNTS}) in any shard",
                        self.kind
                    ),
                })
            }
            None => Ok(0),
        }
    }

    /// Refuses, naming the tensor `name` (of kind `kind`: `param`, `m1` or `m2`) of the shard
    /// `file`, the first index and its value: a value that is NaN or infinite, or a negative
    /// one where the optimizer keeps squares ([`NON_NEGATIVE_STATE`]).
    fn check_values(
        &self,
        name: &str,
        kind: &str,
        values: &[f32],
        file: &Path,
    ) -> Result<(), CheckpointError> {
        check_finite(name, values, file)?;
        let slot = match kind {
            "m1" => self.slots.first(),
            "m2" => self.slots.get(1),
            _ => None,
        };
        let Some(slot) = slot.filter(|s| NON_NEGATIVE_STATE.contains(&s.as_str())) else {
            return Ok(());
        };
        match values.iter().position(|v| *v < 0.0) {
            Some(index) => Err(CheckpointError::Impossible {
                file: file.to_path_buf(),
                name: name.to_string(),
                index,
                value: values[index],
                reason: format!("a {slot} of {} cannot be negative", self.kind),
            }),
            None => Ok(()),
        }
    }

    /// The optimizer's step counts by parameter that a shard's metadata (`meta`, of the shard
    /// `file`) holds. Refused naming the file: another metadata key, a parameter the manifest
    /// (`entries`) does not list, a count that is not a whole number, one beyond the
    /// checkpoint's step, and 0 for an optimizer that counts steps ([`COUNTING_OPTIMIZERS`]:
    /// a count is written only with the state of a parameter that has stepped).
    fn step_counts(
        &self,
        meta: &HashMap<String, String>,
        entries: &HashMap<&str, &ParamEntry>,
        file: &Path,
    ) -> Result<BTreeMap<String, usize>, CheckpointError> {
        let corrupt = |reason: String| CheckpointError::Corrupt {
            file: file.to_path_buf(),
            reason,
        };
        if let Some(key) = meta.keys().find(|k| *k != STEP_COUNTS) {
            return Err(corrupt(format!(
                "unknown metadata key {key:?}: merak writes only {STEP_COUNTS:?}"
            )));
        }
        let Some(text) = meta.get(STEP_COUNTS) else {
            return Ok(BTreeMap::new());
        };
        let counts: BTreeMap<String, serde_json::Value> =
            serde_json::from_str(text).map_err(|e| corrupt(format!("{STEP_COUNTS}: {e}")))?;
        let counting = COUNTING_OPTIMIZERS.contains(&self.kind.as_str());
        let mut out = BTreeMap::new();
        for (name, count) in counts {
            if !entries.contains_key(name.as_str()) {
                return Err(corrupt(format!(
                    "{STEP_COUNTS} names {name}, a parameter the manifest does not list"
                )));
            }
            let why = match count.as_u64().map(|t| (t, usize::try_from(t))) {
                Some((0, _)) if counting => format!(
                    "{} writes a count only once the parameter has stepped",
                    self.kind
                ),
                Some((_, Ok(t))) if t <= self.step => {
                    out.insert(name, t);
                    continue;
                }
                Some(_) => format!("beyond the checkpoint's step {}", self.step),
                None => "not a whole number".into(),
            };
            return Err(corrupt(format!(
                "{STEP_COUNTS} of {name} is {count}: {why}"
            )));
        }
        Ok(out)
    }
}

/// Refuses centered RMSprop state (`full`, of the checkpoint in `dir` whose manifest is `m`)
/// that no run reaches: its squared-gradient average (`m1`) is at least the square of its
/// gradient average (`m2`), up to rounding, as the square root of their difference needs.
fn check_centered(full: &FullState, m: &Manifest, dir: &Path) -> Result<(), CheckpointError> {
    let (kind, slots) = m.stored_optimizer();
    let centered = ["squared-gradient average", "gradient average"];
    if !slots.iter().map(String::as_str).eq(centered) {
        return Ok(());
    }
    let mut names: Vec<&String> = full.moments.keys().collect();
    names.sort();
    for name in names {
        let state = &full.moments[name];
        let below =
            |(sq, avg): (&f32, &f32)| f64::from(*sq) < f64::from(*avg).powi(2) * (1.0 - 1e-5);
        if let Some(index) = state.m1.iter().zip(&state.m2).position(below) {
            return Err(CheckpointError::Impossible {
                file: dir.to_path_buf(),
                name: format!("m1/{name}"),
                index,
                value: state.m1[index],
                reason: format!(
                    "a squared-gradient average of {kind} below the square of its gradient \
                     average ({})",
                    state.m2[index]
                ),
            });
        }
    }
    Ok(())
}

/// Fails naming the shard `file`, the tensor and the first value that is NaN or infinite.
fn check_finite(name: &str, values: &[f32], file: &Path) -> Result<(), CheckpointError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(CheckpointError::NonFinite {
            file: file.to_path_buf(),
            name: name.to_string(),
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}

impl FullState {
    /// This rank's pieces of every tensor for a model whose parameters are `shapes` (name,
    /// local shape, split) on a TP group described by `shard`: (parameters, moments), by the model's
    /// names. `copies` lists `(copy, original)` names of tied parameters: a copy is loaded from
    /// its original. Fails naming the parameter if the model and the checkpoint disagree on a
    /// name, shape or split. A checkpoint parameter that this rank does not hold (another
    /// pipeline stage) is skipped; [`Manifest::check_covers`] checks a whole model.
    pub fn cut_for(
        &self,
        manifest: &Manifest,
        shapes: &[ParamShape],
        shard: Shard,
        copies: &[(String, String)],
    ) -> Result<LocalPieces, CheckpointError> {
        let entries: HashMap<&str, &ParamEntry> = manifest
            .params
            .iter()
            .map(|p| (p.name.as_str(), p))
            .collect();
        cut_pieces(
            &entries,
            &|name| self.params.get(name).map(Vec::as_slice),
            &self.moments,
            shapes,
            shard,
            copies,
        )
    }
}

impl Checkpoint {
    /// Checks that the ranks of `world`, which together hold the whole model, hold every
    /// parameter of the checkpoint: `shapes` are this rank's parameters and `copies` its
    /// tied `(copy, original)` names (a copy counts as its original). A checkpoint parameter
    /// that no rank holds would be dropped silently ([`FullState::cut_for`] loads what a rank
    /// holds, and a pipeline rank holds only its stages); every rank of `world` must call it,
    /// and all fail alike, naming a few such parameters and counting them.
    pub fn check_held(
        &self,
        shapes: &[ParamShape],
        copies: &[(String, String)],
        world: &dyn crate::comm::Communicator,
    ) -> Result<(), CheckpointError> {
        let held: std::collections::HashSet<&str> =
            shapes.iter().map(|p| source_of(&p.name, copies)).collect();
        let params = &self.manifest.params;
        let mut flags: Vec<f32> = (params.iter())
            .map(|p| f32::from(u8::from(held.contains(p.name.as_str()))))
            .collect();
        world.all_reduce(&mut flags, crate::comm::ReduceOp::Max)?;
        let extra: Vec<String> = (params.iter().zip(&flags))
            .filter(|(_, held)| **held == 0.0)
            .map(|(p, _)| p.name.clone())
            .collect();
        match extra.is_empty() {
            true => Ok(()),
            false => Err(CheckpointError::Unmatched {
                extra,
                missing: Vec::new(),
            }),
        }
    }
}

/// The original of `name` when it is a tied copy (`copies` lists `(copy, original)`).
fn source_of<'a>(name: &'a str, copies: &'a [(String, String)]) -> &'a str {
    copies
        .iter()
        .find(|(copy, _)| copy == name)
        .map_or(name, |(_, original)| original.as_str())
}

/// This rank's pieces of the full tensors described by `entries` (parameters from `param`,
/// moments from `moments`) for the model parameters `shapes`; see [`FullState::cut_for`].
fn cut_pieces<'a>(
    entries: &HashMap<&str, &ParamEntry>,
    param: &dyn Fn(&str) -> Option<&'a [f32]>,
    moments: &HashMap<String, Moments>,
    shapes: &[ParamShape],
    shard: Shard,
    copies: &[(String, String)],
) -> Result<LocalPieces, CheckpointError> {
    let mut missing: Vec<String> = (shapes.iter())
        .map(|p| source_of(&p.name, copies))
        .filter(|name| !entries.contains_key(name))
        .map(str::to_string)
        .collect();
    missing.dedup();
    if !missing.is_empty() {
        return Err(CheckpointError::Unmatched {
            extra: Vec::new(),
            missing,
        });
    }
    let mut params = HashMap::new();
    let mut local_moments = HashMap::new();
    for ParamShape {
        name,
        shape: local,
        split: kind,
        ..
    } in shapes
    {
        let kind = *kind;
        let source = source_of(name, copies);
        let Some(entry) = entries.get(source) else {
            continue;
        };
        let full_shape = kind.full_shape(local, shard.size);
        if full_shape != entry.shape {
            return Err(CheckpointError::Mismatch {
                name: name.clone(),
                reason: format!(
                    "shape {:?} in the checkpoint, {full_shape:?} in the model",
                    entry.shape
                ),
            });
        }
        if kind != entry.shard {
            return Err(CheckpointError::Mismatch {
                name: name.clone(),
                reason: format!(
                    "split {:?} in the checkpoint, {kind:?} in the model",
                    entry.shard
                ),
            });
        }
        let cut = |v: &[f32]| kind.cut(v, &entry.shape, shard);
        if let Some(v) = param(source) {
            params.insert(name.clone(), cut(v));
        }
        if let Some(m) = moments.get(source) {
            local_moments.insert(
                name.clone(),
                Moments {
                    time: m.time,
                    m1: cut(&m.m1),
                    m2: cut(&m.m2),
                },
            );
        }
    }
    Ok((params, local_moments))
}

/// This rank's pieces of full-size parameters that come without a manifest (pretrained
/// weights read from another format), for a model whose parameters are `shapes` (as
/// [`state::param_shapes`](super::state::param_shapes) lists them) on a TP group described by `shard`.
/// `full` maps the model's names to (full shape, row-major values); each parameter is split
/// the way the model declares it split and cut like a checkpoint's
/// ([`FullState::cut_for`]), so a vocabulary-parallel token table is padded with zero rows.
/// `copies` lists `(copy, original)` names of tied parameters: a copy is cut from its
/// original. Fails naming the parameter if one of `shapes` is missing from `full` or has
/// another full shape; entries of `full` that this rank does not hold (other pipeline stages)
/// are skipped. The result goes to [`state::assign_params`](super::state::assign_params).
pub fn cut_full_params(
    full: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    shapes: &[ParamShape],
    shard: Shard,
    copies: &[(String, String)],
) -> Result<HashMap<String, Vec<f32>>, CheckpointError> {
    let entries: Vec<ParamEntry> = shapes
        .iter()
        .filter_map(|p| {
            let source = source_of(&p.name, copies);
            full.get(source).map(|(shape, _)| ParamEntry {
                name: source.to_string(),
                shape: shape.clone(),
                shard: p.split,
            })
        })
        .collect();
    let entries: HashMap<&str, &ParamEntry> =
        entries.iter().map(|p| (p.name.as_str(), p)).collect();
    let (params, _) = cut_pieces(
        &entries,
        &|name| full.get(name).map(|(_, v)| v.as_slice()),
        &HashMap::new(),
        shapes,
        shard,
        copies,
    )?;
    Ok(params)
}

#[cfg(test)]
mod piece_tests {
    use burn::module::ParamId;

    use super::*;
    use crate::checkpoint::{LocalParam, RankState, RunId, TensorPiece, save};
    use crate::grid::ProcessGrid;
    use crate::tensor_parallel::ShardKind;

    /// A checkpoint of one parameter `w` of 6 values written as ZeRO pieces starting at `starts`
    /// (each to the next, the last to the end), for the parameter (values `0..6`) and both
    /// moments; returns what reading it gives.
    fn read_back(starts: &[usize], len: usize) -> Result<FullState, CheckpointError> {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut pieces = Vec::new();
        for (i, &start) in starts.iter().enumerate() {
            let end = starts.get(i + 1).copied().unwrap_or(len);
            for kind in ["param", "m1", "m2"] {
                pieces.push(TensorPiece {
                    kind,
                    name: "w".into(),
                    start,
                    values: (start..end).map(|v| v as f32).collect(),
                    time: 4,
                });
            }
        }
        let state = RankState {
            params: vec![LocalParam {
                name: "w".into(),
                id: ParamId::new(),
                shape: vec![2, 3],
                split: ShardKind::Replicated,
                values: Vec::new(),
            }],
            moments: Vec::new(),
            pieces,
        };
        let grid = ProcessGrid::single();
        let step = save(
            dir.path(),
            &RunId::new(),
            4,
            1,
            &state,
            serde_json::Value::Null,
            &grid,
        )
        .expect("saved");
        Checkpoint::open(&step)?.read_full()
    }

    #[test]
    fn pieces_are_put_together_and_gaps_overlaps_and_overruns_are_named() {
        let full = read_back(&[0, 2, 5], 6).expect("read");
        let want: Vec<f32> = (0..6).map(|v| v as f32).collect();
        assert_eq!(full.params["w"], want);
        assert_eq!(
            (full.moments["w"].m1.clone(), full.moments["w"].time),
            (want, 4)
        );
        // Slices that stop short of the tensor's end, or run past it.
        let e = read_back(&[0, 2], 5).expect_err("short").to_string();
        assert!(
            e.contains("w") && e.contains("end at element 5 of 6"),
            "{e}"
        );
        let e = read_back(&[0, 4], 7).expect_err("past the end").to_string();
        assert!(e.contains("w@4") && e.contains("past"), "{e}");
        // A rank's piece missing in the middle.
        let e = join_pieces(vec![(0, vec![0.0; 2]), (3, vec![0.0; 3])], 6).expect_err("gap");
        assert!(e.contains("gap at element 2"), "{e}");
        let e = join_pieces(vec![(0, vec![0.0; 3]), (2, vec![0.0; 4])], 6).expect_err("overlap");
        assert!(e.contains("overlap at element 2"), "{e}");
    }
}
