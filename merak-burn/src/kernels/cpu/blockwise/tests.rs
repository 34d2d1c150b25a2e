//! The blockwise attention against dense attention in `f64` straight from the definition:
//! values, log-sum-exp and gradients, on ragged shapes, causal or not, with global positions
//! and segment ids; a ring of pairs merged against the whole; rows that see no key.

use proptest::prelude::*;

use super::*;

/// Deterministic values in `[-1.5, 1.5)` (splitmix64).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        })
        .collect()
}

type Rows = Vec<Vec<f64>>;

/// Dense attention of one head in `f64`: for the loss `sum(w * out)`, the context, the
/// log-sum-exp and the gradients of Q, K and V.
struct Dense {
    out: Rows,
    lse: Vec<f64>,
    dq: Rows,
    dk: Rows,
    dv: Rows,
}

fn dense(q: &Rows, k: &Rows, v: &Rows, w: &Rows, visible: impl Fn(usize, usize) -> bool) -> Dense {
    let (m, n, d) = (q.len(), k.len(), q[0].len());
    let dv_ = v.first().map_or(d, Vec::len);
    let scale = 1.0 / (d as f64).sqrt();
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut p = vec![vec![0.0; n]; m];
    let mut lse = vec![f64::NEG_INFINITY; m];
    for i in 0..m {
        let sc: Vec<Option<f64>> = (0..n)
            .map(|j| visible(i, j).then(|| dot(&q[i], &k[j]) * scale))
            .collect();
        let top = sc
            .iter()
            .flatten()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        if top == f64::NEG_INFINITY {
            continue;
        }
        let z: f64 = sc.iter().flatten().map(|x| (x - top).exp()).sum();
        lse[i] = top + z.ln();
        for j in 0..n {
            if let Some(x) = sc[j] {
                p[i][j] = (x - top).exp() / z;
            }
        }
    }
    let out: Rows = (0..m)
        .map(|i| {
            (0..dv_)
                .map(|e| (0..n).map(|j| p[i][j] * v[j][e]).sum())
                .collect()
        })
        .collect();
    let dv = (0..n)
        .map(|j| {
            (0..dv_)
                .map(|e| (0..m).map(|i| p[i][j] * w[i][e]).sum())
                .collect()
        })
        .collect();
    let ds: Rows = (0..m)
        .map(|i| {
            let dp: Vec<f64> = (0..n).map(|j| dot(&w[i], &v[j])).collect();
            let c: f64 = (0..n).map(|j| p[i][j] * dp[j]).sum();
            (0..n).map(|j| p[i][j] * (dp[j] - c) * scale).collect()
        })
        .collect();
    let dq = (0..m)
        .map(|i| {
            (0..d)
                .map(|e| (0..n).map(|j| ds[i][j] * k[j][e]).sum())
                .collect()
        })
        .collect();
    let dk = (0..n)
        .map(|j| {
            (0..d)
                .map(|e| (0..m).map(|i| ds[i][j] * q[i][e]).sum())
                .collect()
        })
        .collect();
    Dense {
        out,
        lse,
        dq,
        dk,
        dv,
    }
}

/// Asserts `got` is finite and within `1e-5` of `want` relative to `want`'s root mean square,
/// or absolutely within `1e-6` (root mean square) where that is below `0.1`: a gradient that is
/// 0 by symmetry (a query with one visible key) is rounding noise in `f32`.
fn close(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(got.iter().all(|x| x.is_finite()), "{what}: not finite");
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    let floor = 0.01 * want.len().max(1) as f64;
    let e = (num / den.max(floor)).sqrt();
    assert!(e <= 1e-5, "{what}: relative error {e:e}");
}

/// Log-sum-exps equal, `-inf` where the reference has `-inf`.
fn close_lse(what: &str, got: &[f32], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "{what}: row {i}");
        } else {
            assert!(
                (g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what}: row {i}: {g} vs {w}"
            );
        }
    }
}

fn flat(rows: &Rows) -> Vec<f64> {
    rows.iter().flatten().copied().collect()
}

/// Rows `rows` of a `[n, d]` matrix given flat.
fn to_rows(buf: &[f32], n: usize, d: usize) -> Rows {
    (0..n)
        .map(|i| buf[i * d..(i + 1) * d].iter().map(|&x| x as f64).collect())
        .collect()
}

/// How a test lays out positions and segments.
#[derive(Clone, Copy, Debug)]
struct MaskKind {
    causal: bool,
    /// 0: `0..seq`; 1: from an offset; 2: a random list (repeats allowed).
    positions: u8,
    /// 0: none; 1: sorted runs (packed documents); 2: random ids in 0..3.
    segments: u8,
}

fn make_positions(kind: u8, n: usize, seed: u64) -> (Positions<'static>, Vec<usize>) {
    match kind {
        0 => (Positions::From(0), (0..n).collect()),
        1 => {
            let start = (seed % 1000) as usize;
            (Positions::From(start), (start..start + n).collect())
        }
        _ => {
            let list: Vec<usize> = values(n, seed)
                .iter()
                .map(|x| ((x + 1.5) / 3.0 * 2.0 * n as f32) as usize)
                .collect();
            (Positions::From(0), list)
        }
    }
}

fn make_segments(kind: u8, n: usize, seed: u64) -> Option<Vec<i64>> {
    let r = values(n, seed ^ 0x5E6);
    match kind {
        0 => None,
        1 => {
            let mut id = 0;
            Some(
                r.iter()
                    .map(|x| {
                        if *x > 1.3 {
                            id += 1;
                        }
                        id
                    })
                    .collect(),
            )
        }
        _ => Some(r.iter().map(|x| ((x + 1.5) as i64).min(2)).collect()),
    }
}

/// The fused forward and backward against the dense reference for every head.
fn check_fused(batch: usize, seq: usize, heads: usize, head_dim: usize, kind: MaskKind, seed: u64) {
    let shape = Shape {
        batch,
        seq,
        heads,
        head_dim,
    };
    let (from, pos_list) = make_positions(kind.positions, seq, seed);
    let positions = if kind.positions == 2 {
        Positions::List(&pos_list)
    } else {
        from
    };
    let segs = make_segments(kind.segments, batch * seq, seed);
    let mask = SelfMask {
        causal: kind.causal,
        positions,
        segments: segs.as_deref(),
    };
    let qkv = values(shape.qkv_len(), seed ^ 1);
    let dctx = values(shape.ctx_len(), seed ^ 2);
    let mut ctx = vec![f32::NAN; shape.ctx_len()];
    let mut lse = vec![f32::NAN; shape.lse_len()];
    forward(&qkv, shape, mask, &mut ctx, &mut lse);
    let mut dqkv = vec![0.0; shape.qkv_len()];
    backward(&qkv, &ctx, &lse, &dctx, shape, mask, &mut dqkv);
    let (s, d, hh) = (seq, head_dim, heads);
    for b in 0..batch {
        for h in 0..hh {
            let part = |buf: &[f32], which: usize| -> Rows {
                (0..s)
                    .map(|i| {
                        (0..d)
                            .map(|e| buf[((b * s + i) * 3 + which) * hh * d + h * d + e] as f64)
                            .collect()
                    })
                    .collect()
            };
            let head = |buf: &[f32]| -> Vec<f32> {
                (0..s)
                    .flat_map(|i| {
                        let at = ((b * s + i) * hh + h) * d;
                        buf[at..at + d].to_vec()
                    })
                    .collect()
            };
            let w = to_rows(&head(&dctx), s, d);
            let seg = segs.as_ref().map(|x| &x[b * s..(b + 1) * s]);
            let visible = |i: usize, j: usize| {
                (!kind.causal || pos_list[j] <= pos_list[i]) && seg.is_none_or(|x| x[i] == x[j])
            };
            let want = dense(&part(&qkv, 0), &part(&qkv, 1), &part(&qkv, 2), &w, visible);
            let tag = format!("b{b} h{h} {kind:?} seq {s} d {d}");
            close(&format!("ctx {tag}"), &head(&ctx), &flat(&want.out));
            close_lse(
                &format!("lse {tag}"),
                &lse[shape.lse_range(b, h)],
                &want.lse,
            );
            for (which, g) in [&want.dq, &want.dk, &want.dv].into_iter().enumerate() {
                let got: Vec<f32> = flat(&part(&dqkv, which))
                    .iter()
                    .map(|&x| x as f32)
                    .collect();
                close(&format!("grad {which} {tag}"), &got, &flat(g));
            }
        }
    }
}

#[test]
fn fused_matches_the_definition_on_fixed_shapes() {
    // One block, a ragged last block, exact blocks, several query and key blocks.
    for (batch, seq, heads, head_dim) in
        [(2, 11, 3, 5), (1, 64, 2, 8), (1, 70, 2, 3), (2, 150, 1, 16)]
    {
        for causal in [true, false] {
            for segments in [0, 1] {
                let kind = MaskKind {
                    causal,
                    positions: 0,
                    segments,
                };
                check_fused(batch, seq, heads, head_dim, kind, 7);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn fused_matches_the_definition(
        batch in 1usize..=2,
        seq in 1usize..=160,
        heads in 1usize..=3,
        head_dim in 4usize..=16,
        causal in any::<bool>(),
        positions in 0u8..3,
        segments in 0u8..3,
        seed in any::<u64>(),
    ) {
        let kind = MaskKind { causal, positions, segments };
        check_fused(batch, seq, heads, head_dim, kind, seed);
    }

    /// Context parallelism's ring on one head: the sequence cut into `2 cp` chunks, rank `r`
    /// holding chunks `r` and `2 cp - 1 - r` (zigzag); each rank's queries against each rank's
    /// keys and values as one pair, merged, equal the attention over the whole sequence; the
    /// pairs' backward passes given the final log-sum-exp sum to the whole gradient.
    #[test]
    fn ring_of_pairs_matches_the_whole(
        cp in 1usize..=3,
        chunk in 1usize..=50,
        head_dim in 4usize..=16,
        causal in any::<bool>(),
        segments in 0u8..3,
        seed in any::<u64>(),
    ) {
        ring(cp, chunk, head_dim, causal, segments, seed);
    }
}

/// One ring rank's keys, values and segment ids.
type KeySide = (Vec<f32>, Vec<f32>, Option<Vec<i64>>);

/// The mask of `queries` against the keys at global positions `rows` (segment ids `segments`).
fn key_mask<'a>(
    causal: bool,
    queries: Tokens<'a>,
    rows: &'a [usize],
    segments: Option<&'a [i64]>,
) -> Mask<'a> {
    Mask {
        causal,
        queries,
        keys: Tokens {
            positions: Positions::List(rows),
            segments,
        },
    }
}

fn ring(cp: usize, chunk: usize, d: usize, causal: bool, segments: u8, seed: u64) {
    let total = 2 * cp * chunk;
    let qkv: Vec<Vec<f32>> = (0..3).map(|i| values(total * d, seed ^ (i + 11))).collect();
    let dout = values(total * d, seed ^ 17);
    let segs = make_segments(segments, total, seed);
    // The tokens of each rank: global positions and the rows they take in the whole.
    let owned: Vec<Vec<usize>> = (0..cp)
        .map(|r| {
            let a = r * chunk..(r + 1) * chunk;
            let b = (2 * cp - 1 - r) * chunk..(2 * cp - r) * chunk;
            a.chain(b).collect()
        })
        .collect();
    let gather = |buf: &[f32], rows: &[usize]| -> Vec<f32> {
        rows.iter()
            .flat_map(|&i| buf[i * d..(i + 1) * d].to_vec())
            .collect()
    };
    let seg_of = |rows: &[usize]| {
        segs.as_ref()
            .map(|s| rows.iter().map(|&i| s[i]).collect::<Vec<i64>>())
    };
    // Each rank's keys, values and segment ids, as they travel around the ring.
    let sides: Vec<KeySide> = (owned.iter())
        .map(|rows| (gather(&qkv[1], rows), gather(&qkv[2], rows), seg_of(rows)))
        .collect();
    let n = 2 * chunk;
    let shape = Shape {
        batch: 1,
        seq: n,
        heads: 1,
        head_dim: d,
    };
    let dense_view = View::new(0, n, d, d, 1);
    let mut dk_all = vec![0.0f32; total * d];
    let mut dv_all = vec![0.0f32; total * d];
    let mut dq_all = vec![0.0f32; total * d];
    let mut out_all = vec![0.0f32; total * d];
    let mut lse_all = vec![0.0f32; total];
    for (r, rows_r) in owned.iter().enumerate() {
        let q = gather(&qkv[0], rows_r);
        let q_seg = seg_of(rows_r);
        let queries = Tokens {
            positions: Positions::List(rows_r),
            segments: q_seg.as_deref(),
        };
        // Forward: one pair per rank of keys, merged in ring order starting at this rank.
        let mut out = vec![0.0f32; n * d];
        let mut lse = vec![f32::NEG_INFINITY; n];
        for step in 0..cp {
            let (rows_k, (k, v, k_seg)) = (&owned[(r + step) % cp], &sides[(r + step) % cp]);
            let mask = key_mask(causal, queries, rows_k, k_seg.as_deref());
            let mut part = vec![f32::NAN; n * d];
            let mut part_lse = vec![f32::NAN; n];
            pair_forward(
                Matrix::new(&q, dense_view),
                Matrix::new(k, dense_view),
                Matrix::new(v, dense_view),
                &mask,
                shape.scale(),
                &mut part,
                dense_view,
                &mut part_lse,
                &mut Scratch::default(),
            );
            assert!(part.iter().all(|x| x.is_finite()), "partial context finite");
            merge(shape, &mut out, &mut lse, &part, &part_lse);
        }
        // Backward: D from the merged context, then each pair with the final lse.
        let dout_r = gather(&dout, rows_r);
        let delta: Vec<f32> = (0..n)
            .map(|i| (0..d).map(|e| out[i * d + e] * dout_r[i * d + e]).sum())
            .collect();
        let mut dq = vec![0.0f32; n * d];
        for step in 0..cp {
            let (rows_k, (k, v, k_seg)) = (&owned[(r + step) % cp], &sides[(r + step) % cp]);
            let mask = key_mask(causal, queries, rows_k, k_seg.as_deref());
            let mut dkv = vec![0.0f32; 2 * n * d];
            let mut grads = Grads::split(
                &mut dq,
                dense_view,
                &mut dkv,
                dense_view,
                View::new(n * d, n, d, d, 1),
            );
            pair_backward(
                Matrix::new(&q, dense_view),
                Matrix::new(k, dense_view),
                Matrix::new(v, dense_view),
                Matrix::new(&dout_r, dense_view),
                &lse,
                &delta,
                &mask,
                shape.scale(),
                &mut grads,
                &mut Scratch::default(),
            );
            for (i, &row) in rows_k.iter().enumerate() {
                for e in 0..d {
                    dk_all[row * d + e] += dkv[i * d + e];
                    dv_all[row * d + e] += dkv[n * d + i * d + e];
                }
            }
        }
        for (i, &row) in rows_r.iter().enumerate() {
            lse_all[row] = lse[i];
            for e in 0..d {
                out_all[row * d + e] = out[i * d + e];
                dq_all[row * d + e] = dq[i * d + e];
            }
        }
    }
    let rows = |buf: &[f32]| to_rows(buf, total, d);
    let visible =
        |i: usize, j: usize| (!causal || j <= i) && segs.as_ref().is_none_or(|s| s[i] == s[j]);
    let want = dense(
        &rows(&qkv[0]),
        &rows(&qkv[1]),
        &rows(&qkv[2]),
        &rows(&dout),
        visible,
    );
    let tag = format!("cp {cp} chunk {chunk} d {d} causal {causal} segments {segments}");
    close(&format!("ring ctx {tag}"), &out_all, &flat(&want.out));
    close_lse(&format!("ring lse {tag}"), &lse_all, &want.lse);
    close(&format!("ring dq {tag}"), &dq_all, &flat(&want.dq));
    close(&format!("ring dk {tag}"), &dk_all, &flat(&want.dk));
    close(&format!("ring dv {tag}"), &dv_all, &flat(&want.dv));
}

/// Queries that see no key of a pair (all keys in their future, or of other segments): context
/// 0 and log-sum-exp `-inf` without NaN, no gradient either way, and merging such a result
/// leaves the other one bit for bit.
#[test]
fn rows_without_visible_keys_give_zero_and_merge_exactly() {
    let (m, n, d) = (70, 90, 8);
    let q = values(m * d, 1);
    let k = values(n * d, 2);
    let v = values(n * d, 3);
    let dout = values(m * d, 4);
    let (qv, kv) = (View::new(0, m, d, d, 1), View::new(0, n, d, d, 1));
    // Queries 0..70 at positions 0..70 see keys at 40.. only causally: rows 0..40 see none.
    // With segments, rows 40..45 are in a segment no key has.
    let q_seg: Vec<i64> = (0..m)
        .map(|i| if (40..45).contains(&i) { 9 } else { 1 })
        .collect();
    let k_seg = vec![1i64; n];
    for with_segments in [false, true] {
        let mask = Mask {
            causal: true,
            queries: Tokens {
                positions: Positions::From(0),
                segments: with_segments.then_some(&q_seg[..]),
            },
            keys: Tokens {
                positions: Positions::From(40),
                segments: with_segments.then_some(&k_seg[..]),
            },
        };
        let blind = if with_segments { 45 } else { 40 };
        let mut out = vec![f32::NAN; m * d];
        let mut lse = vec![f32::NAN; m];
        let scale = 1.0 / (d as f32).sqrt();
        let (qm, km, vm) = (
            Matrix::new(&q, qv),
            Matrix::new(&k, kv),
            Matrix::new(&v, kv),
        );
        pair_forward(
            qm,
            km,
            vm,
            &mask,
            scale,
            &mut out,
            qv,
            &mut lse,
            &mut Scratch::default(),
        );
        assert!(out.iter().all(|x| x.is_finite()));
        assert!(out[..blind * d].iter().all(|&x| x == 0.0));
        assert!(lse[..blind].iter().all(|&x| x == f32::NEG_INFINITY));
        assert!(lse[blind..].iter().all(|x| x.is_finite()));
        // Against the reference.
        let visible = |i: usize, j: usize| j + 40 <= i && (!with_segments || q_seg[i] == k_seg[j]);
        let want = dense(
            &to_rows(&q, m, d),
            &to_rows(&k, n, d),
            &to_rows(&v, n, d),
            &to_rows(&dout, m, d),
            visible,
        );
        close("blind ctx", &out, &flat(&want.out));
        close_lse("blind lse", &lse, &want.lse);
        let delta: Vec<f32> = (0..m)
            .map(|i| (0..d).map(|e| out[i * d + e] * dout[i * d + e]).sum())
            .collect();
        let mut dq = vec![0.0f32; m * d];
        let mut dkv = vec![0.0f32; 2 * n * d];
        let mut grads = Grads::split(&mut dq, qv, &mut dkv, kv, View::new(n * d, n, d, d, 1));
        pair_backward(
            qm,
            km,
            vm,
            Matrix::new(&dout, qv),
            &lse,
            &delta,
            &mask,
            scale,
            &mut grads,
            &mut Scratch::default(),
        );
        assert!(dq.iter().chain(&dkv).all(|x| x.is_finite()));
        assert!(dq[..blind * d].iter().all(|&x| x == 0.0));
        close("blind dq", &dq, &flat(&want.dq));
        close("blind dk", &dkv[..n * d], &flat(&want.dk));
        close("blind dv", &dkv[n * d..], &flat(&want.dv));

        // Merging with an all-blind result changes nothing, in either order.
        let shape = Shape {
            batch: 1,
            seq: m,
            heads: 1,
            head_dim: d,
        };
        let none_out = vec![0.0f32; m * d];
        let none_lse = vec![f32::NEG_INFINITY; m];
        let (mut a, mut za) = (out.clone(), lse.clone());
        merge(shape, &mut a, &mut za, &none_out, &none_lse);
        assert_eq!((a, za), (out.clone(), lse.clone()));
        let (mut a, mut za) = (none_out.clone(), none_lse.clone());
        merge(shape, &mut a, &mut za, &out, &lse);
        assert_eq!((a, za), (out.clone(), lse.clone()));
        let (mut a, mut za) = (none_out.clone(), none_lse.clone());
        merge(shape, &mut a, &mut za, &none_out, &none_lse);
        assert_eq!((a, za), (none_out, none_lse));
    }
}

/// Two halves of the keys (cut inside a block), each as a pair, merged: the attention over all
/// keys, for a fused layout of several sequences and heads.
#[test]
fn merged_halves_equal_all_keys() {
    let shape = Shape {
        batch: 2,
        seq: 77,
        heads: 3,
        head_dim: 6,
    };
    let (s, d) = (shape.seq, shape.head_dim);
    let qkv = values(shape.qkv_len(), 5);
    for causal in [false, true] {
        let mut whole = vec![0.0; shape.ctx_len()];
        let mut whole_lse = vec![0.0; shape.lse_len()];
        let mask = SelfMask {
            causal,
            positions: Positions::From(0),
            segments: None,
        };
        forward(&qkv, shape, mask, &mut whole, &mut whole_lse);
        let mut halves = [
            (vec![0.0; shape.ctx_len()], vec![0.0; shape.lse_len()]),
            (vec![0.0; shape.ctx_len()], vec![0.0; shape.lse_len()]),
        ];
        let cut = 30;
        for b in 0..shape.batch {
            for h in 0..shape.heads {
                let [q, k, v] = shape.qkv_views(b, h);
                for (half, (keys, start)) in [(0..cut, 0), (cut..s, cut)].into_iter().enumerate() {
                    let (k, v) = (rows(k, keys.start, keys.end), rows(v, keys.start, keys.end));
                    let m = Mask {
                        causal,
                        queries: Tokens::PLAIN,
                        keys: Tokens {
                            positions: Positions::From(start),
                            segments: None,
                        },
                    };
                    let (out, lse) = &mut halves[half];
                    pair_forward(
                        Matrix::new(&qkv, q),
                        Matrix::new(&qkv, k),
                        Matrix::new(&qkv, v),
                        &m,
                        shape.scale(),
                        out,
                        shape.ctx_view(b, h),
                        &mut lse[shape.lse_range(b, h)],
                        &mut Scratch::default(),
                    );
                }
            }
        }
        let [(mut out, mut lse), (out_b, lse_b)] = halves;
        merge(shape, &mut out, &mut lse, &out_b, &lse_b);
        let want: Vec<f64> = whole.iter().map(|&x| x as f64).collect();
        close("merged halves", &out, &want);
        let want: Vec<f64> = whole_lse.iter().map(|&x| x as f64).collect();
        close_lse("merged halves lse", &lse, &want);
        let _ = d;
    }
}
