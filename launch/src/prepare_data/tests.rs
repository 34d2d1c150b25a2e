//! `prepare-data`'s tests: streaming gives the tokens of the whole text, and nothing the
//! command did not create is changed.

use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use super::output::DATA_SET_FILES;
use super::split::{Splitter, safe_cut};
use super::*;
use super::{MAX_UNCUT_BYTES, MAX_WHITESPACE_RUN};
use merak_burn::data::TokenData;
use proptest::prelude::*;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("merak-tokens-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The names in `dir` and their contents (folders as empty).
fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let bytes = std::fs::read(e.path()).unwrap_or_default();
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect();
    v.sort();
    v
}

/// Runs `f` in a thread; `None` if it has not returned within 20 s (it blocked).
fn within_20s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20)).ok()
}

/// The tokens of a data set's `train.bin` and `val.bin`, in order.
fn token_files(dir: &Path) -> Vec<u32> {
    let bytes = [
        std::fs::read(dir.join("train.bin")).unwrap(),
        std::fs::read(dir.join("val.bin")).unwrap(),
    ];
    bytes
        .concat()
        .chunks_exact(2)
        .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
        .collect()
}

/// A job without progress bar.
fn job<'a>(inputs: &'a [PathBuf], output: &'a Path) -> Job<'a> {
    Job {
        inputs,
        output,
        tokenizer: "gpt2",
        val_fraction: 0.1,
        progress: false,
    }
}

fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mkfifo {}", path.display());
}

/// The tokens of `text` streamed through a [`Splitter`] in chunks of `chunk` bytes, and
/// how many times text was taken out before the end.
fn streamed(text: &str, chunk: usize) -> (Vec<u32>, usize) {
    let bpe = tiktoken_rs::r50k_base_singleton();
    let path = Path::new("text");
    let mut s = Splitter::default();
    let (mut out, mut takes) = (Vec::new(), 0);
    for c in text.as_bytes().chunks(chunk) {
        s.push(c);
        if let Some(ready) = s.take_ready(path).unwrap() {
            out.extend(bpe.encode_ordinary(&ready));
            takes += 1;
        }
    }
    out.extend(bpe.encode_ordinary(&s.finish(path).unwrap()));
    (out, takes)
}

#[test]
fn prepare_then_read_round_trips_through_the_tokenizer() {
    let d = tmp("rt");
    let text = "It was the best of times, it was the worst of times. ".repeat(40);
    std::fs::write(d.join("a.txt"), &text).unwrap();
    let meta = prepare(&[d.join("a.txt")], &d.join("ds"), "gpt2", 0.1).unwrap();
    assert_eq!(meta.vocab_size, 50257);
    let data = TokenData::open(&d.join("ds"), 8, 50257, 1).unwrap();
    assert_eq!(
        data.train.token_count() + data.val.token_count(),
        meta.train_tokens + meta.val_tokens
    );
    let all: Vec<u32> = data
        .train
        .read(0, data.train.token_count() as usize)
        .into_iter()
        .chain(data.val.read(0, data.val.token_count() as usize))
        .map(|t| t as u32)
        .collect();
    assert_eq!(*all.last().unwrap(), GPT2_EOT);
    let bpe = tiktoken_rs::r50k_base().unwrap();
    assert_eq!(bpe.decode(&all[..all.len() - 1]).unwrap(), text);
    // Batches: targets are inputs shifted by one (that an epoch visits each window once is
    // checked in merak_burn::data).
    let (x, y) = data.train_batch(0, 2);
    assert_eq!(x[1..8], y[..7]);
    // Only the data set is left: no temporary file.
    let names: Vec<String> = contents(&d.join("ds")).into_iter().map(|x| x.0).collect();
    assert_eq!(names, ["meta.json", "train.bin", "val.bin"]);
}

#[test]
fn bad_data_sets_are_named() {
    let d = tmp("bad");
    let e = TokenData::open(&d, 8, 50257, 1).err().unwrap().to_string();
    assert!(e.contains("meta.json") && e.contains("prepare-data"), "{e}");
    std::fs::write(d.join("a.txt"), "word ".repeat(200)).unwrap();
    prepare(&[d.join("a.txt")], &d, "gpt2", 0.1).unwrap();
    let e = TokenData::open(&d, 8, 512, 1).err().unwrap().to_string();
    assert!(
        e.contains("model.vocab_size is 512") && e.contains("50257"),
        "{e}"
    );
    let e = TokenData::open(&d, 4096, 50257, 1)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("too few"), "{e}");
    // Truncate the training file.
    let bytes = std::fs::read(d.join("train.bin")).unwrap();
    std::fs::write(d.join("train.bin"), &bytes[..bytes.len() - 2]).unwrap();
    let e = TokenData::open(&d, 8, 50257, 1).err().unwrap().to_string();
    assert!(e.contains("train.bin") && e.contains("truncated"), "{e}");
    std::fs::write(d.join("empty.txt"), "").unwrap();
    let e = prepare(&[d.join("empty.txt")], &d.join("x"), "gpt2", 0.1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");
    let e = prepare(&[d.join("missing.txt")], &d.join("x"), "gpt2", 0.1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.txt"), "{e}");
    // The failed runs made d/x and removed it again.
    assert!(!d.join("x").exists());
}

#[test]
fn cut_points_follow_the_pre_tokenizer() {
    // Before whitespace after a word, and between an ASCII digit and a non-digit.
    for (a, b) in [
        ('a', ' '),
        ('.', '\n'),
        ('9', 'x'),
        ('x', '9'),
        ('\'', '1'),
        ('日', '\u{3000}'),
    ] {
        assert!(safe_cut(a, b), "{a:?} {b:?}");
    }
    // Never after whitespace, inside a run, before a letter after an apostrophe, or
    // between digits of any script.
    for (a, b) in [
        (' ', 'a'),
        ('\n', '\n'),
        (' ', ' '),
        ('a', 'b'),
        ('\'', 's'),
        ('.', ','),
        ('1', '2'),
        ('1', '٣'),
        ('٣', '1'),
        ('a', '.'),
    ] {
        assert!(!safe_cut(a, b), "{a:?} {b:?}");
    }
}

#[test]
fn streaming_in_tiny_chunks_gives_the_tokens_of_the_whole_text() {
    let bpe = tiktoken_rs::r50k_base_singleton();
    let long_word = "abcdefghij".repeat(300);
    let texts = [
        "Hello world, it's 2024!\n\nNew  paragraph\twith   runs of spaces.\n   \n".to_string(),
        format!("start {long_word} end {long_word}"),
        format!("{}\n{long_word}", " ".repeat(3000)),
        "naïve café — 日本語のテキスト 🙂🙂 ٣٤٥ 12ab34 x'll y's 'twas\u{a0}nbsp\u{2028}ls".into(),
        "trailing whitespace   \n\n  ".into(),
        "   leading".into(),
    ];
    for text in &texts {
        let whole = bpe.encode_ordinary(text);
        for chunk in [1, 2, 3, 5, 7, 64] {
            assert_eq!(streamed(text, chunk).0, whole, "chunk {chunk}: {text:?}");
        }
    }
    // The text was cut on the way (not held to the end).
    assert!(streamed(&texts[0], 4).1 > 5);
}

#[test]
fn a_stretch_without_a_cut_is_refused_beyond_the_limit() {
    let mut s = Splitter {
        offset: 10,
        ..Splitter::default()
    };
    let e = (0..=MAX_UNCUT_BYTES / 65536)
        .map(|_| {
            s.push(&[b'a'; 65536]);
            s.take_ready(Path::new("long.txt"))
        })
        .find_map(Result::err)
        .expect("refused")
        .to_string();
    assert!(
        e.contains("long.txt") && e.contains("offset 10") && e.contains("4194304"),
        "{e}"
    );
}

#[test]
fn a_whitespace_run_too_long_for_the_tokenizer_is_refused() {
    let d = tmp("spaces");
    // The longest run taken gives the tokens of the whole text.
    let text = format!("a{}b", " ".repeat(MAX_WHITESPACE_RUN));
    std::fs::write(d.join("ok.txt"), &text).unwrap();
    prepare(&[d.join("ok.txt")], &d.join("ok"), "gpt2", 0.1).unwrap();
    let mut want = tiktoken_rs::r50k_base_singleton().encode_ordinary(&text);
    want.push(GPT2_EOT);
    assert_eq!(token_files(&d.join("ok")), want);
    // A run of about a million spaces made tiktoken-rs panic; one more than the limit is
    // refused.
    let text = format!("ab{}c", "\n".repeat(MAX_WHITESPACE_RUN + 1));
    std::fs::write(d.join("bad.txt"), &text).unwrap();
    let e = prepare(&[d.join("bad.txt")], &d.join("bad"), "gpt2", 0.1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.txt") && e.contains("offset 2") && e.contains("whitespace"),
        "{e}"
    );
    assert!(!d.join("bad").exists());
}

#[test]
fn invalid_utf8_is_named_with_its_offset() {
    let d = tmp("utf8");
    let mut bytes = "word ".repeat(1000).into_bytes();
    bytes[3001] = 0xff;
    std::fs::write(d.join("bin.txt"), &bytes).unwrap();
    let e = prepare(&[d.join("bin.txt")], &d.join("ds"), "gpt2", 0.1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bin.txt") && e.contains("offset 3001"), "{e}");
    // A character cut at the end of the file.
    std::fs::write(d.join("cut.txt"), &"é".as_bytes()[..1]).unwrap();
    let e = prepare(&[d.join("cut.txt")], &d.join("ds"), "gpt2", 0.1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cut.txt") && e.contains("offset 0"), "{e}");
    assert!(!d.join("ds").exists());
}

#[test]
fn a_large_input_is_streamed_in_chunks_to_the_same_tokens() {
    let d = tmp("large");
    let line = "The quick brown fox jumps over 13 lazy dogs; naïve café.\n";
    let text = line.repeat(3 * CHUNK_BYTES / line.len());
    std::fs::write(d.join("big.txt"), &text).unwrap();
    let meta = prepare(&[d.join("big.txt")], &d.join("ds"), "gpt2", 0.05).unwrap();
    let mut want = tiktoken_rs::r50k_base_singleton().encode_ordinary(&text);
    want.push(GPT2_EOT);
    assert_eq!(token_files(&d.join("ds")), want);
    let n = want.len() as u64;
    assert_eq!(meta.val_tokens, ((n as f64 * 0.05).round() as u64).max(1));
    assert_eq!(meta.train_tokens + meta.val_tokens, n);
}

#[test]
fn a_fifo_is_streamed() {
    let d = tmp("fifo");
    let fifo = d.join("corpus.fifo");
    mkfifo(&fifo);
    let text = "piped text, 42 words or so.\n".repeat(5000);
    let (writer, t) = (fifo.clone(), text.clone());
    let w = std::thread::spawn(move || std::fs::write(writer, t));
    let out = d.join("ds");
    let meta = within_20s(move || prepare(&[fifo], &out, "gpt2", 0.1))
        .expect("returned")
        .unwrap();
    w.join().unwrap().unwrap();
    let mut want = tiktoken_rs::r50k_base_singleton().encode_ordinary(&text);
    want.push(GPT2_EOT);
    assert_eq!(token_files(&d.join("ds")), want);
    assert_eq!(meta.train_tokens + meta.val_tokens, want.len() as u64);
}

#[test]
fn an_existing_output_file_or_data_set_is_refused_at_once_and_left_alone() {
    let d = tmp("refuse");
    // The input blocks forever (a FIFO nobody writes): refusing must come first.
    let fifo = d.join("never.fifo");
    mkfifo(&fifo);
    std::fs::write(d.join("file"), "mine").unwrap();
    let (i, o) = (fifo.clone(), d.join("file"));
    let e = within_20s(move || prepare(&[i], &o, "gpt2", 0.1))
        .expect("refused at once")
        .unwrap_err();
    assert_eq!(e.exit_status(), 2);
    let e = e.to_string();
    assert!(
        e.contains("--output") && e.contains("file") && e.contains("not a folder"),
        "{e}"
    );
    assert_eq!(std::fs::read(d.join("file")).unwrap(), b"mine");
    for name in DATA_SET_FILES {
        let ds = d.join(format!("ds-{name}"));
        std::fs::create_dir_all(&ds).unwrap();
        std::fs::write(ds.join(name), "old").unwrap();
        std::fs::write(ds.join("notes.txt"), "mine").unwrap();
        let before = contents(&ds);
        let (i, o) = (fifo.clone(), ds.clone());
        let e = within_20s(move || prepare(&[i], &o, "gpt2", 0.1))
            .expect("refused at once")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&ds.display().to_string())
                && e.contains(name)
                && e.contains("another folder"),
            "{e}"
        );
        assert_eq!(contents(&ds), before);
    }
    // A folder as input is named.
    let e = prepare(std::slice::from_ref(&d), &d.join("ds"), "gpt2", 0.1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&d.display().to_string()) && e.contains("is a folder"),
        "{e}"
    );
}

#[test]
fn user_files_beside_the_output_survive_success_and_failure() {
    let d = tmp("beside");
    let out = d.join("out");
    std::fs::create_dir_all(&out).unwrap();
    // The names the old code used for its temporary files.
    for name in ["train.tmp", "val.tmp", "meta.tmp", "notes.txt"] {
        std::fs::write(out.join(name), name).unwrap();
    }
    let before = contents(&out);
    std::fs::write(d.join("a.txt"), "some text ".repeat(100)).unwrap();
    std::fs::write(d.join("empty.txt"), "").unwrap();
    // A failure on the second input leaves the folder as it was.
    let e = prepare(&[d.join("a.txt"), d.join("empty.txt")], &out, "gpt2", 0.1);
    assert!(e.is_err());
    assert_eq!(contents(&out), before);
    // A stop signal too, and a folder it made is removed again.
    let inputs = [d.join("a.txt")];
    let stop = AtomicUsize::new(2);
    let e = job(&inputs, &out).run(&stop).unwrap_err();
    assert_eq!(e.exit_status(), 130);
    assert!(e.to_string().contains("SIGINT"), "{e}");
    assert_eq!(contents(&out), before);
    let fresh = d.join("new/deeper");
    assert!(job(&inputs, &fresh).run(&stop).is_err());
    assert!(!d.join("new").exists());
    // Success adds the data set and changes nothing else.
    prepare(&[d.join("a.txt")], &out, "gpt2", 0.1).unwrap();
    let after = contents(&out);
    let kept: Vec<_> = after
        .iter()
        .filter(|x| !DATA_SET_FILES.contains(&x.0.as_str()))
        .cloned()
        .collect();
    assert_eq!(kept, before);
    assert_eq!(after.len(), before.len() + 3);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 300,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Streaming varied text (runs of spaces and newlines, unicode, digits, contractions) in
    /// tiny chunks gives exactly the token ids of the whole text.
    #[test]
    fn streamed_tokens_equal_whole_text_tokens(
        parts in prop::collection::vec(prop::sample::select(vec![
            "a", "word", "Hello", " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \n", "'s",
            "'ll", "'", "'re", "1", "2024", "٣", "½", ".", ",", "!?", "é", "e\u{301}",
            "日本語", "🙂", "\u{a0}", "\u{3000}", "\u{2028}", "-", "$5", "x1y", "ǅ", "Ⅻ",
        ]), 0..120),
        chunk in 1usize..17,
    ) {
        let text: String = parts.concat();
        let whole = tiktoken_rs::r50k_base_singleton().encode_ordinary(&text);
        prop_assert_eq!(streamed(&text, chunk).0, whole);
    }
}
