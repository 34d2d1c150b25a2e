//! The program the multi-rank tests run under `mpirun`: `mpi-worker SCENARIO`.
//!
//! Each scenario checks the parallel result against a serial computation done on the same rank
//! and panics on any mismatch (the panic hook aborts the job, so the test sees a non-zero exit).
//! On success every rank prints `rank R: SCENARIO ok`.
//!
//! Scenarios: `comm` (every communicator operation, the all-to-all included), `grid` (sub-communicator membership),
//! `layers` (tensor-parallel layers against tp = 1, forward and backward), `overlap` (the
//! chunked, overlapped row- and column-parallel products and blocks against the serial ones),
//! `thread` (`comm` and `overlap` over a `ProgressThreadComm`, MPI initialised with
//! `MPI_THREAD_MULTIPLE`), `sequence` (a transformer block under sequence parallelism against
//! one rank), `panic` (rank 1 panics while rank 0 waits for it).

use std::rc::Rc;

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use merak_burn::backend::{Cpu, CpuAutodiff};
use merak_burn::comm::{Communicator, Group, MpiWorld, ProgressThreadComm, ReduceOp, TensorComm};
use merak_burn::grid::{Layout, ProcessGrid};
use merak_burn::tensor_parallel::{
    AttentionMask, AttentionWeights, ColumnParallelLinear, InitRng, MlpWeights, ParallelMlp,
    ParallelSelfAttention, RowParallelLinear, Shard, VocabParallelEmbedding,
    vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_unfused,
};
use merak_tests::rel_err;

#[path = "../worker/sequence.rs"]
mod sequence_scenario;

type B = CpuAutodiff;
type I = Cpu;

const TOL: f64 = 1e-5;

fn main() {
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let mpi = if scenario == "thread" {
        MpiWorld::init_thread_multiple().expect("MPI initialises with MPI_THREAD_MULTIPLE")
    } else {
        MpiWorld::init().expect("MPI initialises")
    };
    let world = mpi.world();
    let rank = world.rank();
    match scenario.as_str() {
        "thread" => thread_progress(&mpi),
        "comm" => comm(&world),
        "grid" => grid(mpi.world()),
        "layers" => layers(Group::register(Rc::new(mpi.world()))),
        "panic" => panic_scenario(&world),
        "scatter" => scatter(Group::register(Rc::new(mpi.world()))),
        "overlap" => overlap(Group::register(Rc::new(mpi.world()))),
        "sequence" => sequence_scenario::sequence(Group::register(Rc::new(mpi.world()))),
        other => panic!("unknown scenario {other:?}"),
    }
    println!("rank {rank}: {scenario} ok");
}

/// The communicator whose non-blocking all-reduces run on a communication thread: every
/// operation, and the overlapped layers over it.
fn thread_progress(mpi: &MpiWorld) {
    let threaded = ProgressThreadComm::new(mpi.world()).expect("MPI_THREAD_MULTIPLE");
    comm(&threaded);
    overlap(Group::register(Rc::new(threaded)));
}

fn data(rank: usize, n: usize) -> Vec<f32> {
    // Multiples of 1/4 below 2^20: every sum below is exact in f32.
    (0..n)
        .map(|i| (rank as f32 + 1.0) * 0.5 + (i % 97) as f32 * 0.25)
        .collect()
}

fn expect(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g == w, "{name}: element {i} is {g}, expected {w}");
    }
}

/// Blocks of ragged sizes, empty ones among them: rank `r` sends `(r + 2 j) % 3` values of
/// `data(r n + j)` to rank `j`, blocking and non-blocking; counts that do not add up are refused.
fn all_to_all_v(c: &dyn Communicator) {
    let (r, n) = (c.rank(), c.size());
    let size = |from: usize, to: usize| (from + 2 * to) % 3;
    let send_counts: Vec<usize> = (0..n).map(|j| size(r, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|i| size(i, r)).collect();
    let send: Vec<f32> = (0..n).flat_map(|j| data(r * n + j, size(r, j))).collect();
    let want: Vec<f32> = (0..n).flat_map(|i| data(i * n + r, size(i, r))).collect();
    let mut recv = vec![0.0; want.len()];
    c.all_to_all_v(&send, &send_counts, &mut recv, &recv_counts)
        .unwrap();
    expect("all_to_all_v", &recv, &want);
    let mut flight = c
        .all_to_all_v_start(send.clone(), &send_counts, &recv_counts)
        .unwrap();
    flight.test().unwrap();
    expect("all_to_all_v_start", &flight.wait().unwrap(), &want);
    let mut short = send_counts.clone();
    short[0] += 1;
    assert!(
        c.all_to_all_v_start(send, &short, &recv_counts).is_err(),
        "counts above the values sent must be refused"
    );
}

fn comm(c: &dyn Communicator) {
    let (r, n) = (c.rank(), c.size());
    let len = 10;
    let all: Vec<Vec<f32>> = (0..n).map(|q| data(q, len)).collect();
    let sum: Vec<f32> = (0..len).map(|i| all.iter().map(|v| v[i]).sum()).collect();
    let max: Vec<f32> = (0..len)
        .map(|i| all.iter().map(|v| v[i]).fold(f32::MIN, f32::max))
        .collect();

    for (op, want) in [
        (ReduceOp::Sum, sum.clone()),
        (ReduceOp::Max, max.clone()),
        (ReduceOp::Mean, sum.iter().map(|s| s / n as f32).collect()),
    ] {
        let mut buf = data(r, len);
        c.all_reduce(&mut buf, op).unwrap();
        expect(&format!("all_reduce {op:?}"), &buf, &want);
    }

    let mut gathered = vec![0.0; len * n];
    c.all_gather(&data(r, len), &mut gathered).unwrap();
    expect("all_gather", &gathered, &all.concat());

    let big: Vec<Vec<f32>> = (0..n).map(|q| data(q, len * n)).collect();
    let big_sum: Vec<f32> = (0..len * n)
        .map(|i| big.iter().map(|v| v[i]).sum())
        .collect();
    let mut part = vec![0.0; len];
    c.reduce_scatter(&data(r, len * n), &mut part, ReduceOp::Sum)
        .unwrap();
    expect("reduce_scatter", &part, &big_sum[r * len..(r + 1) * len]);

    // All-to-all: block j of rank r's send (values from data(r n + j)) arrives as block r of
    // rank j; blocks of 3 values, and none.
    let send: Vec<f32> = (0..n).flat_map(|j| data(r * n + j, 3)).collect();
    let mut recv = vec![0.0; 3 * n];
    c.all_to_all(&send, &mut recv).unwrap();
    let want: Vec<f32> = (0..n).flat_map(|i| data(i * n + r, 3)).collect();
    expect("all_to_all", &recv, &want);
    c.all_to_all(&[], &mut []).unwrap();
    assert!(
        n == 1
            || c.all_to_all(&vec![0.0; n + 1], &mut vec![0.0; n + 1])
                .is_err(),
        "all_to_all of size+1 values must be refused"
    );
    all_to_all_v(c);

    let root = n - 1;
    let mut b = data(r, len);
    c.broadcast(&mut b, root).unwrap();
    expect("broadcast", &b, &all[root]);
    let mut bytes = vec![r as u8; 128];
    c.broadcast_bytes(&mut bytes, 0).unwrap();
    assert!(bytes.iter().all(|&x| x == 0), "broadcast_bytes");

    if n > 1 {
        // A ring: everyone sends to the next rank and receives from the previous one.
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut got = vec![0.0; len];
        if r % 2 == 0 {
            c.send(&data(r, len), next, 7).unwrap();
            c.recv(&mut got, prev, 7).unwrap();
        } else {
            c.recv(&mut got, prev, 7).unwrap();
            c.send(&data(r, len), next, 7).unwrap();
        }
        expect("send/recv", &got, &all[prev]);
        // Receives posted ahead: one waited for after its message was sent, and one whose
        // message never comes, dropped (cancelled, not waited for).
        let posted = c.recv_start(len, prev, 8).unwrap();
        let never = c.recv_start(len, prev, 9).unwrap();
        c.send(&data(r, len), next, 8).unwrap();
        expect("recv_start", &posted.wait().unwrap(), &all[prev]);
        drop(never);
    }
    c.barrier().unwrap();

    // Non-blocking all-reduce of a large buffer, progressed by test() between compute chunks.
    let nb = 1 << 20;
    let mut pending = c.all_reduce_start(data(r, nb), ReduceOp::Sum).unwrap();
    let mut spins = 0u64;
    let mut acc = 0.0f64;
    while !pending.test().unwrap() {
        acc += (0..1000).map(|i| (i as f64).sqrt()).sum::<f64>();
        spins += 1;
    }
    assert!(acc >= 0.0);
    let out = pending.wait().unwrap();
    let want: Vec<f32> = (0..nb)
        .map(|i| (0..n).map(|q| data(q, 97)[i % 97]).sum())
        .collect();
    expect("all_reduce_start", &out, &want);
    eprintln!("rank {r}: non-blocking all-reduce completed after {spins} progress calls");
    let mut nb_max = c.all_reduce_start(data(r, len), ReduceOp::Max).unwrap();
    while !nb_max.test().unwrap() {}
    expect("all_reduce_start max", &nb_max.wait().unwrap(), &max);
    // Non-blocking reduce-scatter (sum and mean) and all-gather, two in flight at once.
    let mut rs = c
        .reduce_scatter_start(data(r, len * n), ReduceOp::Sum)
        .unwrap();
    let ag = c.all_gather_start(data(r, len)).unwrap();
    let mean = c
        .reduce_scatter_start(data(r, len * n), ReduceOp::Mean)
        .unwrap();
    while !rs.test().unwrap() {}
    expect(
        "reduce_scatter_start",
        &rs.wait().unwrap(),
        &big_sum[r * len..(r + 1) * len],
    );
    expect("all_gather_start", &ag.wait().unwrap(), &all.concat());
    let want: Vec<f32> = big_sum[r * len..(r + 1) * len]
        .iter()
        .map(|s| s / n as f32)
        .collect();
    expect("reduce_scatter_start mean", &mean.wait().unwrap(), &want);
    let uneven = c.reduce_scatter_start(vec![0.0; n + 1], ReduceOp::Sum);
    assert!(
        n == 1 || uneven.is_err(),
        "a send buffer of size+1 values must be refused"
    );

    // The same operations on Burn tensors.
    let dev = Default::default();
    let t =
        |v: Vec<f32>, shape: [usize; 2]| Tensor::<I, 2>::from_data(TensorData::new(v, shape), &dev);
    let values = |t: Tensor<I, 2>| t.into_data().into_vec::<f32>().unwrap();
    let reduced = c
        .all_reduce_tensor(t(data(r, len), [2, 5]), ReduceOp::Sum)
        .unwrap();
    expect("all_reduce_tensor", &values(reduced), &sum);
    let g = c.all_gather_tensor(t(data(r, len), [2, 5]), 1).unwrap();
    assert_eq!(g.dims(), [2, 5 * n]);
    let gv = values(g);
    for q in 0..n {
        for row in 0..2 {
            expect(
                "all_gather_tensor",
                &gv[row * 5 * n + q * 5..row * 5 * n + q * 5 + 5],
                &all[q][row * 5..row * 5 + 5],
            );
        }
    }
    let rs = c
        .reduce_scatter_tensor(t(data(r, 2 * n), [2, n]), 1, ReduceOp::Sum)
        .unwrap();
    let full: Vec<Vec<f32>> = (0..n).map(|q| data(q, 2 * n)).collect();
    let want: Vec<f32> = (0..2)
        .map(|row| full.iter().map(|v| v[row * n + r]).sum())
        .collect();
    expect("reduce_scatter_tensor", &values(rs), &want);
    let a2a = c.all_to_all_tensor(t(data(r, 2 * n), [2, n]), 1).unwrap();
    // Column j of rank r goes to rank j: column q of the result is rank q's column r.
    let want: Vec<f32> = (0..2)
        .flat_map(|row| (0..n).map(move |q| (row, q)))
        .map(|(row, q)| full[q][row * n + r])
        .collect();
    expect("all_to_all_tensor", &values(a2a), &want);
    let bt = c.broadcast_tensor(t(data(r, len), [2, 5]), root).unwrap();
    expect("broadcast_tensor", &values(bt), &all[root]);
    if n > 1 {
        if r == 0 {
            c.send_tensor(t(data(r, len), [2, 5]), 1, 9).unwrap();
        } else if r == 1 {
            let got = c.recv_tensor::<I, 2>([2, 5], 0, 9, &dev).unwrap();
            expect("send_tensor/recv_tensor", &values(got), &all[0]);
        }
    }
    // Bad arguments are errors, not crashes.
    assert!(c.all_gather(&[1.0], &mut [0.0; 0]).is_err());
    assert!(c.broadcast(&mut [0.0], n).is_err());
}

fn grid(world: merak_burn::comm::MpiCommunicator) {
    let n = world.size();
    let layout = match n {
        4 => Layout {
            dp: 2,
            tp: 2,
            cp: 1,
            pp: 1,
        },
        8 => Layout {
            dp: 2,
            tp: 2,
            cp: 1,
            pp: 2,
        },
        _ => Layout {
            dp: 1,
            tp: n,
            cp: 1,
            pp: 1,
        },
    };
    let g = ProcessGrid::from_mpi(world, layout).unwrap();
    let c = g.coords;
    assert_eq!(layout.rank_of(c), g.rank);
    // Each group holds exactly the ranks that share the other two coordinates, in order.
    for (name, group, members) in [
        (
            "tp",
            g.tp,
            (0..layout.tp)
                .map(|t| layout.rank_of(merak_burn::grid::Coords { tp: t, ..c }))
                .collect::<Vec<_>>(),
        ),
        (
            "dp",
            g.dp,
            (0..layout.dp)
                .map(|d| layout.rank_of(merak_burn::grid::Coords { dp: d, ..c }))
                .collect(),
        ),
        (
            "pp",
            g.pp,
            (0..layout.pp)
                .map(|p| layout.rank_of(merak_burn::grid::Coords { pp: p, ..c }))
                .collect(),
        ),
    ] {
        let comm = group.comm().unwrap();
        let mut got = vec![0.0; comm.size()];
        comm.all_gather(&[g.rank as f32], &mut got).unwrap();
        let got: Vec<usize> = got.iter().map(|x| *x as usize).collect();
        assert_eq!(got, members, "{name} group of rank {}", g.rank);
    }
}

/// A reduce-scattering reducer (ZeRO-2), an all-reducing one read as chunks (ZeRO-1) and, at
/// dp = 4, a hybrid one hand each rank exactly its pieces of the gradients the all-reducing
/// reducer gives every rank, and zeros in the padding past each bucket.
fn scatter(dp: Group) {
    use burn::module::{Module, ModuleVisitor, Param};
    use merak_burn::data_parallel::{Collective, DataParallel, Sharding};
    let dev = Default::default();
    let r = dp.rank();
    let w = MlpWeights {
        fc_weight: (0..16 * 64)
            .map(|i| (i % 13) as f32 * 0.01 - 0.06)
            .collect(),
        fc_bias: vec![0.01; 64],
        proj_weight: (0..64 * 16).map(|i| (i % 7) as f32 * 0.02 - 0.06).collect(),
        proj_bias: vec![0.0; 16],
    };
    let mlp = ParallelMlp::<B>::from_full(&w, 16, 64, Group::local(), &dev).unwrap();
    let all = DataParallel::new(&mlp, dp, 300).unwrap();
    let rs = DataParallel::new(&mlp, dp, 300)
        .unwrap()
        .with_collective(Collective::ReduceScatter, Sharding::over(dp))
        .unwrap();
    let run = |reducer: &DataParallel| {
        reducer.begin_step();
        reducer.set_last_micro_batch(true);
        let x = Tensor::<B, 3>::from_data(TensorData::new(data(r, 96), [2, 3, 16]), &dev);
        reducer.hooked(mlp.clone()).forward(x).sum().backward();
    };
    run(&all);
    let (grads, _) = all.finish::<B, _>(&mlp).unwrap();
    run(&rs);
    let (chunks, stats) = rs.finish_chunks().unwrap();
    // The all-reduced gradients, flat in visit order.
    struct Flat<'a>(&'a burn::optim::GradientsParams, Vec<f32>, Vec<usize>);
    impl ModuleVisitor<B> for Flat<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let g = self.0.get::<Cpu, D>(p.id).expect("a gradient");
            self.2.push(self.1.len());
            self.1.extend(to_vec(g));
        }
    }
    let mut flat = Flat(&grads, Vec::new(), Vec::new());
    mlp.visit(&mut flat);
    assert_eq!(chunks.len(), stats.buckets);
    let held = pieces_match(
        "reduce-scattered",
        &chunks,
        &rs.rank_chunks(),
        &flat.1,
        &flat.2,
    );
    let mut total = [held as f32];
    dp.comm()
        .unwrap()
        .all_reduce(&mut total, ReduceOp::Sum)
        .unwrap();
    assert_eq!(
        total[0] as usize,
        flat.1.len(),
        "the ranks' pieces cover every gradient"
    );
    // ZeRO-1 on slices: the all-reduced buckets, cut into the same chunks.
    let sliced = DataParallel::new(&mlp, dp, 300)
        .unwrap()
        .with_collective(Collective::AllReduceChunked, Sharding::over(dp))
        .unwrap();
    run(&sliced);
    let (same, _) = sliced.finish_chunks().unwrap();
    pieces_match("ZeRO-1 sliced", &same, &rs.rank_chunks(), &flat.1, &flat.2);
    // Hybrid sharding at dp = 4: two copies of two ranks each; the chunks of the shard
    // group, summed over the copies.
    if dp.size() == 4 {
        let comm = dp.comm().unwrap();
        let shard = Group::register(comm.split(r / 2, r % 2).unwrap());
        let copies = Group::register(comm.split(r % 2, r / 2).unwrap());
        let hybrid = DataParallel::new(&mlp, dp, 300)
            .unwrap()
            .with_collective(
                Collective::ReduceScatter,
                Sharding {
                    shard,
                    replicate: Some(copies),
                    experts: None,
                },
            )
            .unwrap();
        run(&hybrid);
        let (chunks, _) = hybrid.finish_chunks().unwrap();
        let rank_chunks = hybrid.rank_chunks();
        assert_eq!(rank_chunks.rank, r % 2);
        pieces_match("hybrid", &chunks, &rank_chunks, &flat.1, &flat.2);
    }
}

/// Checks that each of `chunks` holds, at its `slices` pieces, the values of the flat
/// all-reduced gradients `flat` (parameter `p` at `offsets[p]`) and zeros elsewhere; returns
/// the values held.
fn pieces_match(
    name: &str,
    chunks: &[Vec<f32>],
    rank_chunks: &merak_burn::data_parallel::chunks::RankChunks,
    flat: &[f32],
    offsets: &[usize],
) -> usize {
    let mut held = 0;
    for (b, chunk) in chunks.iter().enumerate() {
        assert_eq!(
            chunk.len(),
            rank_chunks.buckets[b].chunk,
            "{name}: bucket {b}"
        );
        let mut covered = vec![false; chunk.len()];
        for p in rank_chunks.pieces.iter().filter(|p| p.bucket == b) {
            let at = offsets[p.param] + p.param_start;
            let got = chunk[p.chunk_offset..p.chunk_offset + p.len].to_vec();
            check(name, got, flat[at..at + p.len].to_vec());
            covered[p.chunk_offset..p.chunk_offset + p.len].fill(true);
            held += p.len;
        }
        let mut padding = chunk.iter().zip(&covered).filter(|(_, c)| !**c);
        assert!(
            padding.all(|(v, _)| *v == 0.0),
            "{name}: bucket {b}: padding not zero"
        );
    }
    held
}

fn panic_scenario(c: &dyn Communicator) {
    c.barrier().unwrap();
    if c.rank() == 1 {
        panic!("deliberate failure in the panic scenario");
    }
    // Everyone else waits for a message that rank 1 will never send.
    let mut buf = [0.0f32; 1];
    c.recv(&mut buf, 1, 99).unwrap();
}

// ---------------------------------------------------------------- tensor-parallel layers

fn to_vec<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

fn check(name: &str, got: Vec<f32>, want: Vec<f32>) {
    let e = rel_err(&got, &want);
    assert!(e <= TOL, "{name}: relative error {e:e} > {TOL:e}");
}

fn input(rng: &InitRng, name: &str, shape: [usize; 3]) -> Tensor<B, 3> {
    let v = rng.normal(name, shape.iter().product(), 1.0);
    Tensor::<B, 3>::from_data(TensorData::new(v, shape), &Default::default()).require_grad()
}

/// Slices the last dimension of a row-major `[rows, cols]` buffer like a column shard.
fn cols(shard: Shard, v: &[f32], cols: usize, segments: usize) -> Vec<f32> {
    shard.columns(v, v.len() / cols, cols, segments)
}

fn layers(tp: Group) {
    let local = Group::local();
    let shard = Shard {
        rank: tp.rank(),
        size: tp.size(),
    };
    let rng = InitRng::new(42);
    let dev = Default::default();
    let (b, s, h, heads) = (2, 5, 8, 4);

    // Column-parallel linear, output split and output gathered.
    for gather in [false, true] {
        let w = rng.normal("col.w", h * 12, 0.3);
        let bias = rng.normal("col.b", 12, 0.3);
        let par = ColumnParallelLinear::<B>::from_full(&w, Some(&bias), h, 12, 1, gather, tp, &dev)
            .unwrap();
        let ser =
            ColumnParallelLinear::<B>::from_full(&w, Some(&bias), h, 12, 1, gather, local, &dev)
                .unwrap();
        let (xp, xs) = (
            input(&rng, "col.x", [b, s, h]),
            input(&rng, "col.x", [b, s, h]),
        );
        let (yp, ys) = (par.forward(xp.clone()), ser.forward(xs.clone()));
        let out_w = rng.normal("col.g", b * s * 12, 1.0);
        let out_w_local = if gather {
            out_w.clone()
        } else {
            cols(shard, &out_w, 12, 1)
        };
        let wt =
            |v: Vec<f32>, n: usize| Tensor::<B, 3>::from_data(TensorData::new(v, [b, s, n]), &dev);
        let n_par = if gather { 12 } else { 12 / tp.size() };
        let gp = (yp.clone() * wt(out_w_local, n_par)).sum().backward();
        let gs = (ys.clone() * wt(out_w, 12)).sum().backward();
        let ys_v = to_vec(ys);
        check(
            "column forward",
            to_vec(yp),
            if gather {
                ys_v
            } else {
                cols(shard, &ys_v, 12, 1)
            },
        );
        check(
            "column input grad",
            to_vec(xp.grad(&gp).unwrap()),
            to_vec(xs.grad(&gs).unwrap()),
        );
        check(
            "column weight grad",
            to_vec(par.linear.weight.grad(&gp).unwrap()),
            cols(shard, &to_vec(ser.linear.weight.grad(&gs).unwrap()), 12, 1),
        );
        check(
            "column bias grad",
            to_vec(par.linear.bias.as_ref().unwrap().grad(&gp).unwrap()),
            cols(
                shard,
                &to_vec(ser.linear.bias.as_ref().unwrap().grad(&gs).unwrap()),
                12,
                1,
            ),
        );
    }

    // Row-parallel linear: input split over features.
    {
        let w = rng.normal("row.w", 12 * h, 0.3);
        let bias = rng.normal("row.b", h, 0.3);
        let par = RowParallelLinear::<B>::from_full(&w, Some(&bias), 12, h, tp, &dev).unwrap();
        let ser = RowParallelLinear::<B>::from_full(&w, Some(&bias), 12, h, local, &dev).unwrap();
        let full = rng.normal("row.x", b * s * 12, 1.0);
        let xs = Tensor::<B, 3>::from_data(TensorData::new(full.clone(), [b, s, 12]), &dev)
            .require_grad();
        let xp = Tensor::<B, 3>::from_data(
            TensorData::new(cols(shard, &full, 12, 1), [b, s, 12 / tp.size()]),
            &dev,
        )
        .require_grad();
        let out_w = Tensor::<B, 3>::from_data(
            TensorData::new(rng.normal("row.g", b * s * h, 1.0), [b, s, h]),
            &dev,
        );
        let (yp, ys) = (par.forward(xp.clone()), ser.forward(xs.clone()));
        let gp = (yp.clone() * out_w.clone()).sum().backward();
        let gs = (ys.clone() * out_w).sum().backward();
        check("row forward", to_vec(yp), to_vec(ys));
        check(
            "row input grad",
            to_vec(xp.grad(&gp).unwrap()),
            cols(shard, &to_vec(xs.grad(&gs).unwrap()), 12, 1),
        );
        check(
            "row weight grad",
            to_vec(par.linear.weight.grad(&gp).unwrap()),
            shard.rows(&to_vec(ser.linear.weight.grad(&gs).unwrap()), 12, h),
        );
        assert!(par.linear.bias.is_none(), "the bias is added after the sum");
        check(
            "row bias grad",
            to_vec(par.bias.as_ref().unwrap().grad(&gp).unwrap()),
            to_vec(ser.bias.as_ref().unwrap().grad(&gs).unwrap()),
        );
    }

    // Vocabulary-parallel embedding, tied head and cross-entropy, with a vocabulary (10)
    // that tp = 4 does not divide.
    {
        let vocab = 10;
        let table = rng.normal("emb.w", vocab * h, 0.5);
        let par = VocabParallelEmbedding::<B>::from_full(&table, vocab, h, tp, &dev).unwrap();
        let ser = VocabParallelEmbedding::<B>::from_full(&table, vocab, h, local, &dev).unwrap();
        let ids: Vec<i64> = rng
            .integers("emb.ids", b * s, vocab as u64)
            .iter()
            .map(|&x| x as i64)
            .collect();
        let mut targets: Vec<i64> = rng
            .integers("emb.t", b * s, vocab as u64)
            .iter()
            .map(|&x| x as i64)
            .collect();
        targets[3] = -1; // an ignored position
        let ids_t = || Tensor::<B, 2, Int>::from_data(TensorData::new(ids.clone(), [b, s]), &dev);
        let tg_t =
            || Tensor::<B, 2, Int>::from_data(TensorData::new(targets.clone(), [b, s]), &dev);
        let (ep, es) = (par.forward(ids_t()), ser.forward(ids_t()));
        check("embedding forward", to_vec(ep.clone()), to_vec(es.clone()));
        // Loss through the tied head, with the hidden state as an input that needs a gradient.
        let hidden = input(&rng, "emb.hidden", [b, s, h]);
        let (hp, hs) = (hidden.clone() + ep, hidden.clone() + es);
        let lp = vocab_parallel_cross_entropy(par.logits(hp), tg_t(), par.vocab_start(), vocab, tp);
        let ls = vocab_parallel_cross_entropy(ser.logits(hs), tg_t(), 0, vocab, local);
        // An independent reference: Burn's own cross-entropy on full logits.
        let full_logits = ser.logits(hidden.clone().detach() + ser.forward(ids_t()).detach());
        let mask: Vec<bool> = targets.iter().map(|&t| t >= 0).collect();
        let keep: Vec<i64> = targets.iter().map(|&t| t.max(0)).collect();
        let burn_ce = burn::nn::loss::CrossEntropyLossConfig::new()
            .init::<B>(&dev)
            .forward(
                full_logits.reshape([b * s, vocab]).select(
                    0,
                    Tensor::<B, 1, Int>::from_data(
                        TensorData::new(
                            (0..b * s)
                                .filter(|&i| mask[i])
                                .map(|i| i as i64)
                                .collect::<Vec<_>>(),
                            [mask.iter().filter(|m| **m).count()],
                        ),
                        &dev,
                    ),
                ),
                Tensor::<B, 1, Int>::from_data(
                    TensorData::new(
                        (0..b * s)
                            .filter(|&i| mask[i])
                            .map(|i| keep[i])
                            .collect::<Vec<_>>(),
                        [mask.iter().filter(|m| **m).count()],
                    ),
                    &dev,
                ),
            );
        check(
            "cross-entropy vs Burn's",
            to_vec(ls.clone()),
            to_vec(burn_ce),
        );
        check(
            "cross-entropy forward",
            to_vec(lp.clone()),
            to_vec(ls.clone()),
        );
        // The fused operation against its composition of Burn operators, on this TP layout.
        let hidden_u = input(&rng, "emb.hidden", [b, s, h]);
        let lu = vocab_parallel_cross_entropy_unfused(
            par.logits(hidden_u.clone() + par.forward(ids_t())),
            tg_t(),
            par.vocab_start(),
            vocab,
            tp,
        );
        check(
            "cross-entropy fused vs unfused",
            to_vec(lp.clone()),
            to_vec(lu.clone()),
        );
        let (gp, gs, gu) = (lp.backward(), ls.backward(), lu.backward());
        check(
            "cross-entropy hidden grad",
            to_vec(hidden.grad(&gp).unwrap()),
            to_vec(hidden.grad(&gs).unwrap()),
        );
        check(
            "cross-entropy hidden grad, fused vs unfused",
            to_vec(hidden.grad(&gp).unwrap()),
            to_vec(hidden_u.grad(&gu).unwrap()),
        );
        check(
            "embedding weight grad, fused vs unfused",
            to_vec(par.embedding.weight.grad(&gp).unwrap()),
            to_vec(par.embedding.weight.grad(&gu).unwrap()),
        );
        let padded = merak_burn::tensor_parallel::padded_vocab(vocab, tp.size());
        let mut ser_w = to_vec(ser.embedding.weight.grad(&gs).unwrap());
        ser_w.resize(padded * h, 0.0);
        check(
            "embedding weight grad (lookup and head)",
            to_vec(par.embedding.weight.grad(&gp).unwrap()),
            shard.rows(&ser_w, padded, h),
        );
    }

    // Self-attention, causal and bidirectional.
    for mask in [AttentionMask::Causal, AttentionMask::Bidirectional] {
        let w = AttentionWeights {
            qkv_weight: rng.normal("attn.qkv", h * 3 * h, 0.3),
            qkv_bias: rng.normal("attn.qkv.b", 3 * h, 0.1),
            proj_weight: rng.normal("attn.proj", h * h, 0.3),
            proj_bias: rng.normal("attn.proj.b", h, 0.1),
        };
        let par = ParallelSelfAttention::<B>::from_full(&w, h, heads, mask, tp, &dev).unwrap();
        let ser = ParallelSelfAttention::<B>::from_full(&w, h, heads, mask, local, &dev).unwrap();
        let (xp, xs) = (
            input(&rng, "attn.x", [b, s, h]),
            input(&rng, "attn.x", [b, s, h]),
        );
        let out_w = Tensor::<B, 3>::from_data(
            TensorData::new(rng.normal("attn.g", b * s * h, 1.0), [b, s, h]),
            &dev,
        );
        let (yp, ys) = (par.forward(xp.clone()), ser.forward(xs.clone()));
        let gp = (yp.clone() * out_w.clone()).sum().backward();
        let gs = (ys.clone() * out_w).sum().backward();
        let tag = format!("attention {mask:?}");
        check(&format!("{tag} forward"), to_vec(yp.clone()), to_vec(ys));
        check(
            &format!("{tag} input grad"),
            to_vec(xp.grad(&gp).unwrap()),
            to_vec(xs.grad(&gs).unwrap()),
        );
        check(
            &format!("{tag} qkv weight grad"),
            to_vec(par.qkv.linear.weight.grad(&gp).unwrap()),
            cols(
                shard,
                &to_vec(ser.qkv.linear.weight.grad(&gs).unwrap()),
                3 * h,
                3,
            ),
        );
        check(
            &format!("{tag} qkv bias grad"),
            to_vec(par.qkv.linear.bias.as_ref().unwrap().grad(&gp).unwrap()),
            cols(
                shard,
                &to_vec(ser.qkv.linear.bias.as_ref().unwrap().grad(&gs).unwrap()),
                3 * h,
                3,
            ),
        );
        check(
            &format!("{tag} proj weight grad"),
            to_vec(par.proj.linear.weight.grad(&gp).unwrap()),
            shard.rows(&to_vec(ser.proj.linear.weight.grad(&gs).unwrap()), h, h),
        );
        // The fused attention against Burn's composition, on this TP layout.
        let xu = input(&rng, "attn.x", [b, s, h]);
        let yu = par.forward_unfused(xu.clone());
        let gu = (yu.clone() * out_w_again(&rng, "attn.g", [b, s, h]))
            .sum()
            .backward();
        check(
            &format!("{tag} fused vs unfused forward"),
            to_vec(yp),
            to_vec(yu),
        );
        check(
            &format!("{tag} fused vs unfused input grad"),
            to_vec(xp.grad(&gp).unwrap()),
            to_vec(xu.grad(&gu).unwrap()),
        );
        check(
            &format!("{tag} fused vs unfused qkv weight grad"),
            to_vec(par.qkv.linear.weight.grad(&gp).unwrap()),
            to_vec(par.qkv.linear.weight.grad(&gu).unwrap()),
        );
    }

    // MLP.
    {
        let w = MlpWeights {
            fc_weight: rng.normal("mlp.fc", h * 4 * h, 0.3),
            fc_bias: rng.normal("mlp.fc.b", 4 * h, 0.1),
            proj_weight: rng.normal("mlp.proj", 4 * h * h, 0.3),
            proj_bias: rng.normal("mlp.proj.b", h, 0.1),
        };
        let par = ParallelMlp::<B>::from_full(&w, h, 4 * h, tp, &dev).unwrap();
        let ser = ParallelMlp::<B>::from_full(&w, h, 4 * h, local, &dev).unwrap();
        let (xp, xs) = (
            input(&rng, "mlp.x", [b, s, h]),
            input(&rng, "mlp.x", [b, s, h]),
        );
        let out_w = Tensor::<B, 3>::from_data(
            TensorData::new(rng.normal("mlp.g", b * s * h, 1.0), [b, s, h]),
            &dev,
        );
        let (yp, ys) = (par.forward(xp.clone()), ser.forward(xs.clone()));
        let gp = (yp.clone() * out_w.clone()).sum().backward();
        let gs = (ys.clone() * out_w).sum().backward();
        check("mlp forward", to_vec(yp.clone()), to_vec(ys));
        check(
            "mlp input grad",
            to_vec(xp.grad(&gp).unwrap()),
            to_vec(xs.grad(&gs).unwrap()),
        );
        check(
            "mlp fc weight grad",
            to_vec(par.fc.linear.weight.grad(&gp).unwrap()),
            cols(
                shard,
                &to_vec(ser.fc.linear.weight.grad(&gs).unwrap()),
                4 * h,
                1,
            ),
        );
        check(
            "mlp proj weight grad",
            to_vec(par.proj.linear.weight.grad(&gp).unwrap()),
            shard.rows(&to_vec(ser.proj.linear.weight.grad(&gs).unwrap()), 4 * h, h),
        );
        // The fused bias + GELU against Burn's, on this TP layout.
        let xu = input(&rng, "mlp.x", [b, s, h]);
        let yu = par.forward_unfused(xu.clone());
        let gu = (yu.clone() * out_w_again(&rng, "mlp.g", [b, s, h]))
            .sum()
            .backward();
        check("mlp fused vs unfused forward", to_vec(yp), to_vec(yu));
        check(
            "mlp fused vs unfused input grad",
            to_vec(xp.grad(&gp).unwrap()),
            to_vec(xu.grad(&gu).unwrap()),
        );
        check(
            "mlp fused vs unfused fc bias grad",
            to_vec(par.fc.linear.bias.as_ref().unwrap().grad(&gp).unwrap()),
            to_vec(par.fc.linear.bias.as_ref().unwrap().grad(&gu).unwrap()),
        );
    }
}

/// The fixed output weights `name` of a layer check, drawn again.
fn out_w_again(rng: &InitRng, name: &str, shape: [usize; 3]) -> Tensor<B, 3> {
    Tensor::<B, 3>::from_data(
        TensorData::new(rng.normal(name, shape.iter().product(), 1.0), shape),
        &Default::default(),
    )
}

/// A leaf `[rows, cols]` of values drawn for `name` (the same on every rank for the same name).
fn leaf(rng: &InitRng, name: &str, rows: usize, cols: usize) -> Tensor<B, 2> {
    let v = rng.normal(name, rows * cols, 1.0);
    Tensor::<B, 2>::from_data(TensorData::new(v, [rows, cols]), &Default::default()).require_grad()
}

/// The overlapped row- and column-parallel products with 1, 2 and 4 token chunks give the
/// serial layer's output, input gradient and weight gradient; so do the MLP and the attention
/// block sub-pipelined over 2 and 4 chunks.
fn overlap(tp: Group) {
    overlapped_products(tp);
    overlapped_blocks(tp);
}

/// The output, input gradient and every parameter gradient of a block sub-pipelined over 2
/// and 4 token chunks equal those of the same block run serially.
fn overlapped_blocks(tp: Group) {
    use burn::module::Param;
    use merak_burn::tensor_parallel::TpOverlap;
    let rng = InitRng::new(7);
    let dev = Default::default();
    let (b, s, h, heads) = (2, 4, 8, 4);
    let mlp = MlpWeights {
        fc_weight: rng.normal("fc.w", h * 4 * h, 0.3),
        fc_bias: rng.normal("fc.b", 4 * h, 0.3),
        proj_weight: rng.normal("proj.w", 4 * h * h, 0.3),
        proj_bias: rng.normal("proj.b", h, 0.3),
    };
    let attn = AttentionWeights {
        qkv_weight: rng.normal("qkv.w", h * 3 * h, 0.3),
        qkv_bias: rng.normal("qkv.b", 3 * h, 0.3),
        proj_weight: rng.normal("aproj.w", h * h, 0.3),
        proj_bias: rng.normal("aproj.b", h, 0.3),
    };
    let new_mlp = || ParallelMlp::<B>::from_full(&mlp, h, 4 * h, tp, &dev).unwrap();
    let new_attn = || {
        ParallelSelfAttention::<B>::from_full(&attn, h, heads, AttentionMask::Causal, tp, &dev)
            .unwrap()
    };
    // Output, input gradient and parameter gradients (in module order) of one block.
    let run = |forward: &dyn Fn(Tensor<B, 3>) -> Tensor<B, 3>,
               params: &dyn Fn(&_) -> Vec<Vec<f32>>| {
        let x = input(&rng, "x", [b, s, h]);
        let y = forward(x.clone());
        let grads = (y.clone() * out_w_again(&rng, "dy", [b, s, h]))
            .sum()
            .backward();
        let mut all = vec![to_vec(y), to_vec(x.grad(&grads).expect("input gradient"))];
        all.extend(params(&grads));
        all
    };
    let grads2 = |w: &Param<Tensor<B, 2>>, g: &_| to_vec(w.grad(g).expect("weight gradient"));
    let grads1 = |w: &Option<Param<Tensor<B, 1>>>, g: &_| {
        to_vec(w.as_ref().expect("a bias").grad(g).expect("bias gradient"))
    };
    let mlp_run = |m: &ParallelMlp<B>| {
        run(&|x| m.forward(x), &|g| {
            vec![
                grads2(&m.fc.linear.weight, g),
                grads1(&m.fc.linear.bias, g),
                grads2(&m.proj.linear.weight, g),
                grads1(&m.proj.bias, g),
            ]
        })
    };
    let attn_run = |a: &ParallelSelfAttention<B>| {
        run(&|x| a.forward(x), &|g| {
            vec![
                grads2(&a.qkv.linear.weight, g),
                grads1(&a.qkv.linear.bias, g),
                grads2(&a.proj.linear.weight, g),
                grads1(&a.proj.bias, g),
            ]
        })
    };
    let (serial_mlp, serial_attn) = (mlp_run(&new_mlp()), attn_run(&new_attn()));
    let names = [
        "output",
        "input grad",
        "w1 grad",
        "b1 grad",
        "w2 grad",
        "b2 grad",
    ];
    for k in [2, 4] {
        let overlap = TpOverlap::new(k).unwrap();
        let (mut m, mut a) = (new_mlp(), new_attn());
        m.set_overlap(overlap);
        a.set_overlap(overlap);
        for (block, got, want) in [
            ("mlp", mlp_run(&m), &serial_mlp),
            ("attention", attn_run(&a), &serial_attn),
        ] {
            for ((name, g), w) in names.iter().zip(got).zip(want) {
                check(&format!("{block} k={k} {name}"), g, w.clone());
            }
        }
    }
}

/// The overlapped row- and column-parallel products against the serial ones.
fn overlapped_products(tp: Group) {
    use merak_burn::tensor_parallel::overlap::{column_linear, row_linear};
    use merak_burn::tensor_parallel::{copy_to_tp, reduce_from_tp};
    let rng = InitRng::new(11 + tp.rank() as u64);
    let (tokens, d_in, d_out) = (16, 6, 10);
    // Each rank has its own slice of a row-parallel layer and its own weight of a column one;
    // the column layer's input (and the row layer's output gradient) is the same everywhere.
    let shared = InitRng::new(5);
    let x_local = || leaf(&rng, "x_local", tokens, d_in);
    let x_shared = || leaf(&shared, "x_shared", tokens, d_in);
    let w = || leaf(&rng, "w", d_in, d_out);
    let dy = shared.normal("dy", tokens * d_out, 1.0);
    let upstream = || {
        Tensor::<B, 2>::from_data(
            TensorData::new(dy.clone(), [tokens, d_out]),
            &Default::default(),
        )
    };
    let run = |x: Tensor<B, 2>,
               w: Tensor<B, 2>,
               f: &dyn Fn(Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 2>| {
        let y = f(x.clone(), w.clone());
        let grads = (y.clone() * upstream()).sum().backward();
        let g = |t: &Tensor<B, 2>| to_vec(t.grad(&grads).expect("a gradient"));
        (to_vec(y), g(&x), g(&w))
    };
    let serial_row = run(x_local(), w(), &|x, w| reduce_from_tp(x.matmul(w), tp));
    let serial_col = run(x_shared(), w(), &|x, w| copy_to_tp(x, tp).matmul(w));
    for chunks in [1, 2, 4] {
        let row = run(x_local(), w(), &|x, w| row_linear(x, w, chunks, tp));
        let col = run(x_shared(), w(), &|x, w| column_linear(x, w, chunks, tp));
        for (name, got, want) in [("row", row, &serial_row), ("column", col, &serial_col)] {
            check(&format!("{name} k={chunks} output"), got.0, want.0.clone());
            check(
                &format!("{name} k={chunks} input grad"),
                got.1,
                want.1.clone(),
            );
            check(
                &format!("{name} k={chunks} weight grad"),
                got.2,
                want.2.clone(),
            );
        }
    }
}
