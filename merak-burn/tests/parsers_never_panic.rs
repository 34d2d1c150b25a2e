//! Every parser of untrusted input (model shapes, hardware specs, plan files, calibration
//! files, checkpoint manifests, data set metadata, Hugging Face safetensors files) returns a value or an error for arbitrary
//! input, never a panic: random text, and valid files with random edits. The test process
//! runs under a capped allocator ([`merak_tests::CappedAlloc`]), so a parser that allocates by a number read from
//! its input aborts the test instead of passing by overcommit.

use std::path::Path;

use merak_burn::checkpoint::Checkpoint;
use merak_burn::data::TokenData;
use merak_burn::planner::{
    Calibration, HardwareSpec, ModelProxy, PlanFile, SearchOptions, TransformerShape, search,
};
use proptest::prelude::*;

merak_tests::cap_allocations!();

/// Numbers at the edges of what `meta.json`'s fields can hold (and beyond).
const HUGE: [&str; 12] = [
    "0",
    "1",
    "100",
    "50",
    "65536",
    "4294967295",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "-1",
    "1e309",
];

use merak_tests::fresh_folder as folder;

/// `valid` with the edit `(at, cut, insert)`: `cut` bytes removed at `at`, `insert` put there.
fn edited(valid: &[u8], (at, cut, insert): &(usize, usize, Vec<u8>)) -> Vec<u8> {
    let at = at % (valid.len() + 1);
    let end = (at + cut).min(valid.len());
    [&valid[..at], insert.as_slice(), &valid[end..]].concat()
}

/// An edit of a few bytes: where, how many removed, what inserted (often JSON/TOML syntax).
fn edit() -> impl Strategy<Value = (usize, usize, Vec<u8>)> {
    let syntax = prop::sample::select(vec![
        b"{".to_vec(),
        b"}".to_vec(),
        b"\"".to_vec(),
        b"-1".to_vec(),
        b"1e309".to_vec(),
        b"null".to_vec(),
        b"[]".to_vec(),
        b"=".to_vec(),
        b"18446744073709551616".to_vec(),
        b"0".to_vec(),
        b"../".to_vec(),
    ]);
    let bytes = prop::collection::vec(any::<u8>(), 0..8);
    (any::<usize>(), 0usize..16, prop_oneof![syntax, bytes])
}

const TINY: &str = "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=512";

fn valid_plan(dir: &Path) -> Vec<u8> {
    let shape: TransformerShape = TINY.parse().expect("shape");
    let hw = HardwareSpec::preset("local-cpu")
        .expect("preset")
        .with_devices(4);
    let result = search(
        &ModelProxy::from_shape(shape),
        &hw,
        &SearchOptions::new(4, 8),
    )
    .expect("a plan");
    let path = dir.join("valid.json");
    PlanFile::new(shape, "local-cpu", 4, result.best)
        .write(&path)
        .expect("written");
    std::fs::read(&path).expect("read back")
}

/// A calibration of the tiny GPT with one timing.
fn valid_calibration(model: TransformerShape) -> Vec<u8> {
    use merak_burn::planner::{CALIBRATION_FORMAT, UnitKind, UnitTiming};
    let cal = Calibration {
        format: CALIBRATION_FORMAT.into(),
        model,
        backend: "flex-f32".into(),
        ranks: 2,
        element_bytes: 4.0,
        optimizer_s_per_param: 1e-9,
        micro_batch_s_per_param: 0.0,
        step_overhead_s: 0.0,
        zero1_s_per_param: 0.0,
        alone_time_fraction: 0.0,
        timings: vec![UnitTiming {
            unit: UnitKind::Layer,
            tp: 1,
            micro_batch: 1,
            forward_s: 1e-3,
            backward_s: 2e-3,
            tp_overlap: 1,
        }],
    };
    serde_json::to_vec(&cal).expect("json")
}

/// The manifest of a checkpoint with one replicated parameter in one 8-byte shard.
fn valid_manifest() -> Vec<u8> {
    use merak_burn::checkpoint::{FORMAT, FileEntry, Manifest, ParamEntry};
    use merak_burn::tensor_parallel::ShardKind;
    let manifest = Manifest {
        format: FORMAT.into(),
        run: None,
        step: 3,
        layout: merak_burn::grid::Layout {
            dp: 1,
            tp: 1,
            cp: 1,
            pp: 1,
        },
        params: vec![ParamEntry {
            name: "w".into(),
            shape: vec![2],
            shard: ShardKind::Replicated,
        }],
        files: vec![FileEntry {
            file: "s.safetensors".into(),
            bytes: 8,
            sha256: "00".into(),
            tp: 0,
            dp: 0,
        }],
        extra: serde_json::Value::Null,
    };
    serde_json::to_vec(&manifest).expect("json")
}

/// A real one-rank checkpoint of one column-split parameter `w` [2, 6] (3 segments) with
/// AdamW moments, in `dir`; returns the manifest's text.
fn real_checkpoint(dir: &Path) -> String {
    use merak_burn::checkpoint::{LocalParam, Moments, RankState, RunId, save};
    use merak_burn::tensor_parallel::ShardKind;
    let state = RankState {
        params: vec![LocalParam {
            name: "w".into(),
            id: burn::module::ParamId::new(),
            shape: vec![2, 6],
            split: ShardKind::Columns { segments: 3 },
            values: (0..12).map(|i| i as f32).collect(),
        }],
        moments: vec![(
            "w".into(),
            Moments {
                time: 3,
                m1: vec![0.5; 12],
                m2: vec![0.25; 12],
            },
        )],
        pieces: Vec::new(),
    };
    let grid = merak_burn::grid::ProcessGrid::single();
    let step = save(
        dir,
        &RunId::new(),
        3,
        1,
        &state,
        serde_json::Value::Null,
        &grid,
    )
    .expect("saved");
    std::fs::read_to_string(step.join("manifest.json")).expect("manifest")
}

/// Numbers at the edges of what a safetensors header's sizes can hold.
const EXTREMES: [u64; 11] = [
    0,
    1,
    2,
    8,
    64,
    u32::MAX as u64,
    1 << 32,
    1 << 62,
    1 << 63,
    u64::MAX - 4,
    u64::MAX,
];

/// Every tensor of a safetensors file, as f32 where its element type converts (what an
/// importer does with a file): an error names the file.
fn hf_tensors(bytes: &[u8], path: &Path) -> Result<(), String> {
    use merak_burn::hf_files::{tensor_views, to_f32};
    let named = |e: merak_burn::hf_files::HfFileError| {
        let e = e.to_string();
        assert!(e.contains(&path.display().to_string()), "{e}");
        e
    };
    for (name, view) in tensor_views(bytes, path).map_err(named)? {
        let _ = to_f32(&view, path, &name).map_err(named);
    }
    Ok(())
}

/// The manifest fields that hold numbers, as JSON pointers.
const MANIFEST_NUMBERS: [&str; 10] = [
    "/layout/dp",
    "/layout/tp",
    "/layout/pp",
    "/step",
    "/files/0/tp",
    "/files/0/dp",
    "/files/0/bytes",
    "/params/0/shape/0",
    "/params/0/shape/1",
    "/params/0/shard/segments",
];

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 200,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn model_shapes(text in "\\PC{0,60}", e in edit()) {
        let _ = text.parse::<TransformerShape>();
        let mutated = edited(TINY.as_bytes(), &e);
        let _ = String::from_utf8_lossy(&mutated).parse::<TransformerShape>();
    }

    #[test]
    fn hardware_specs(text in "\\PC{0,200}", e in edit()) {
        let _ = HardwareSpec::from_toml(&text);
        let valid = toml::to_string(&HardwareSpec::preset("a100-80g").expect("preset"))
            .expect("toml");
        let _ = HardwareSpec::from_toml(&String::from_utf8_lossy(&edited(valid.as_bytes(), &e)));
    }

    #[test]
    fn plan_files(bytes in prop::collection::vec(any::<u8>(), 0..200), e in edit()) {
        let dir = folder("plan");
        let path = dir.join("plan.json");
        std::fs::write(&path, &bytes).expect("write");
        let _ = PlanFile::read(&path);
        std::fs::write(&path, edited(&valid_plan(&dir), &e)).expect("write");
        let _ = PlanFile::read(&path);
    }

    #[test]
    fn calibration_files(bytes in prop::collection::vec(any::<u8>(), 0..200), e in edit()) {
        let dir = folder("calibration");
        let path = dir.join("calibration.json");
        let shape: TransformerShape = TINY.parse().expect("shape");
        std::fs::write(&path, &bytes).expect("write");
        let _ = Calibration::read(&path, &shape);
        let valid = valid_calibration(shape);
        let valid = valid.as_slice();
        std::fs::write(&path, valid).expect("write");
        let unedited = Calibration::read(&path, &shape);
        prop_assert!(unedited.is_ok(), "the unedited calibration reads: {:?}", unedited.err());
        std::fs::write(&path, edited(valid, &e)).expect("write");
        let _ = Calibration::read(&path, &shape);
    }

    #[test]
    fn checkpoint_manifests(bytes in prop::collection::vec(any::<u8>(), 0..200), e in edit()) {
        let dir = folder("checkpoint");
        std::fs::write(dir.join("manifest.json"), &bytes).expect("write");
        let _ = Checkpoint::open(&dir);
        let valid = valid_manifest();
        std::fs::write(dir.join("s.safetensors"), [0u8; 8]).expect("write");
        std::fs::write(dir.join("manifest.json"), &valid).expect("write");
        let unedited = Checkpoint::open(&dir);
        prop_assert!(unedited.is_ok(), "the unedited manifest opens: {:?}", unedited.err());
        std::fs::write(dir.join("manifest.json"), edited(&valid, &e)).expect("write");
        if let Ok(c) = Checkpoint::open(&dir) {
            let _ = c.read_full();
        }
        std::fs::write(dir.join("latest"), edited(b"step-00000003", &e)).expect("write");
        let _ = Checkpoint::open(&dir);
    }

    #[test]
    fn shard_files(bytes in prop::collection::vec(any::<u8>(), 0..200), at in any::<usize>(), byte in any::<u8>()) {
        use merak_burn::checkpoint::shard_file::{NamedTensor, decode, encode};
        let path = Path::new("shard.safetensors");
        let _ = decode(&bytes, path);
        let tensors = [NamedTensor { name: "w".into(), shape: vec![2, 3], values: vec![1.0; 6] }];
        let valid = encode(&tensors, Default::default()).expect("encoded");
        let mut edited = valid.clone();
        edited[at % valid.len()] = byte;
        let _ = decode(&edited, path);
        prop_assert!(decode(&valid[..valid.len() - 1], path).is_err(), "a cut file is refused");
    }

    #[test]
    fn data_set_metadata(bytes in prop::collection::vec(any::<u8>(), 0..200), e in edit()) {
        let dir = folder("data");
        std::fs::write(dir.join("train.bin"), [1u8; 200]).expect("write");
        std::fs::write(dir.join("val.bin"), [1u8; 100]).expect("write");
        std::fs::write(dir.join("meta.json"), &bytes).expect("write");
        let _ = TokenData::open(&dir, 8, 512, 1);
        let valid = br#"{"tokenizer":"gpt2","vocab_size":512,"eot":0,"dtype":"u16","train_tokens":100,"val_tokens":50,"val_fraction":0.1,"sources":[]}"#;
        std::fs::write(dir.join("meta.json"), valid).expect("write");
        prop_assert!(TokenData::open(&dir, 8, 512, 1).is_ok());
        std::fs::write(dir.join("meta.json"), edited(valid, &e)).expect("write");
        let _ = TokenData::open(&dir, 8, 512, 1);
    }

    #[test]
    fn checkpoint_manifests_with_huge_numbers(
        field in prop::sample::select(MANIFEST_NUMBERS.to_vec()),
        number in prop::sample::select(HUGE.to_vec()),
    ) {
        let dir = folder("checkpoint-huge");
        let manifest = real_checkpoint(&dir);
        let step = dir.join("step-00000003");
        let mut m: serde_json::Value = serde_json::from_str(&manifest).expect("json");
        *m.pointer_mut(field).expect("the field") = "__HUGE__".into();
        let text = m.to_string().replace("\"__HUGE__\"", number);
        std::fs::write(step.join("manifest.json"), text).expect("write");
        // Read only when every number fits the layout and the files: then it is the tensor.
        if let Ok(full) = Checkpoint::open(&step).and_then(|c| c.read_full()) {
            prop_assert_eq!(full.params["w"].len(), 12);
        }
    }

    #[test]
    fn data_set_metadata_with_huge_numbers(
        train in prop::sample::select(HUGE.to_vec()),
        val in prop::sample::select(HUGE.to_vec()),
        vocab in prop::sample::select(HUGE.to_vec()),
        eot in prop::sample::select(HUGE.to_vec()),
        train_bytes in prop::sample::select(vec![0usize, 1, 2, 200, 201]),
    ) {
        let dir = folder("data-huge");
        std::fs::write(dir.join("train.bin"), vec![1u8; train_bytes]).expect("write");
        std::fs::write(dir.join("val.bin"), [1u8; 100]).expect("write");
        let meta = format!(
            r#"{{"tokenizer":"gpt2","vocab_size":{vocab},"eot":{eot},"dtype":"u16","train_tokens":{train},"val_tokens":{val},"val_fraction":0.1,"sources":[]}}"#
        );
        std::fs::write(dir.join("meta.json"), meta).expect("write");
        // Opened only when every number fits the files: then the whole epoch reads.
        if let Ok(data) = TokenData::open(&dir, 8, 65536, 1) {
            prop_assert_eq!(data.train.token_count() * 2, train_bytes as u64);
            prop_assert_eq!(data.val.token_count(), 50);
            let n = data.samples_per_epoch() as usize;
            let (x, y) = data.train_batch(0, 2 * n);
            prop_assert_eq!((x.len(), y.len()), (16 * n, 16 * n));
        }
    }

    /// Random bytes, and a valid file with a byte changed or cut short.
    #[test]
    fn hf_safetensors_files(
        bytes in prop::collection::vec(any::<u8>(), 0..200),
        at in any::<usize>(),
        byte in any::<u8>(),
        cut in 1usize..64,
    ) {
        let path = Path::new("dir/model.safetensors");
        let _ = hf_tensors(&bytes, path);
        let tensors = [("w".into(), vec![2, 3], vec![0.5; 6]), ("b".into(), vec![3], vec![-1.0; 3])];
        for dtype in ["F32", "F16", "BF16", "I32"] {
            let valid = merak_tests::safetensors_file(&tensors, dtype);
            prop_assert!(hf_tensors(&valid, path).is_ok());
            let mut edited = valid.clone();
            edited[at % valid.len()] = byte;
            let _ = hf_tensors(&edited, path);
            prop_assert!(hf_tensors(&valid[..valid.len().saturating_sub(cut)], path).is_err());
        }
    }

    /// Headers with extreme numbers (header lengths, offsets, shapes, dtypes) give an error
    /// naming the file, never a panic or an allocation of their size.
    #[test]
    fn hf_safetensors_headers_with_extreme_numbers(
        length in prop::sample::select(vec![None, Some(0), Some(1), Some(u64::MAX), Some(1 << 63), Some(100_000_001)]),
        dims in prop::collection::vec(prop::sample::select(EXTREMES.to_vec()), 0..4),
        start in prop::sample::select(EXTREMES.to_vec()),
        end in prop::sample::select(EXTREMES.to_vec()),
        dtype in prop::sample::select(vec!["F32", "F16", "BF16", "F64", "U8", "BOOL", "F4", "I64"]),
        data in 0usize..64,
    ) {
        let shape: Vec<String> = dims.iter().map(u64::to_string).collect();
        let header = format!(
            r#"{{"model.embed_tokens.weight":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{start},{end}]}}}}"#,
            shape.join(",")
        );
        let n = length.unwrap_or(header.len() as u64);
        let bytes = [&n.to_le_bytes()[..], header.as_bytes(), &vec![0u8; data]].concat();
        // Only a header whose one tensor fills the data exactly is a file.
        let whole = length.is_none() && start == 0 && end == data as u64;
        let path = Path::new("dir/model.safetensors");
        prop_assert!(hf_tensors(&bytes, path).is_err() || whole);
    }

}
