//! The `sequence` scenario: a pre-LayerNorm transformer block under sequence parallelism
//! against the same block on one rank, forward and backward.

use burn::tensor::{Tensor, TensorData};
use merak_burn::batch::DropoutPosition;
use merak_burn::comm::Group;
use merak_burn::tensor_parallel::{
    AttentionMask, AttentionWeights, HeldPositions, InitRng, LayerNorm, MlpWeights, ParallelMlp,
    ParallelSelfAttention, ReplicatedDropout, SeqShare, TpOverlap,
};

use super::{B, check, to_vec};

/// One block: `x + drop(attn(ln_1(x)))`, then `+ drop(mlp(ln_2(.)))`, on `group`.
struct Block {
    ln_1: LayerNorm<B>,
    attn: ParallelSelfAttention<B>,
    ln_2: LayerNorm<B>,
    mlp: ParallelMlp<B>,
    dropout: ReplicatedDropout,
}

impl Block {
    fn new(rng: &InitRng, [s, h, heads]: [usize; 3], group: Group, sp: Option<TpOverlap>) -> Self {
        let dev = Default::default();
        let attn = AttentionWeights {
            qkv_weight: rng.normal("qkv", h * 3 * h, 0.3),
            qkv_bias: rng.normal("qkv.b", 3 * h, 0.3),
            proj_weight: rng.normal("proj", h * h, 0.3),
            proj_bias: rng.normal("proj.b", h, 0.3),
        };
        let mlp = MlpWeights {
            fc_weight: rng.normal("fc", h * 4 * h, 0.3),
            fc_bias: rng.normal("fc.b", 4 * h, 0.3),
            proj_weight: rng.normal("mlp.proj", 4 * h * h, 0.3),
            proj_bias: rng.normal("mlp.proj.b", h, 0.3),
        };
        let mut block = Self {
            ln_1: LayerNorm::new(h, 1e-5, &dev),
            attn: ParallelSelfAttention::from_full(
                &attn,
                h,
                heads,
                AttentionMask::Causal,
                group,
                &dev,
            )
            .unwrap(),
            ln_2: LayerNorm::new(h, 1e-5, &dev),
            mlp: ParallelMlp::from_full(&mlp, h, 4 * h, group, &dev).unwrap(),
            dropout: ReplicatedDropout::new(0.2, 9),
        };
        if let Some(overlap) = sp {
            block.attn.set_overlap(overlap);
            block.mlp.set_overlap(overlap);
            block.ln_1.set_sequence_parallel(Some(group));
            block.ln_2.set_sequence_parallel(Some(group));
            block.attn.set_sequence_parallel(true);
            block.mlp.set_sequence_parallel(true);
            let share = HeldPositions::whole(s).with_share(SeqShare::of(group));
            block.dropout.set_sequence_rows(share.rows());
        }
        block
    }

    fn forward(&self, x: Tensor<B, 3>, at: &DropoutPosition) -> Tensor<B, 3> {
        let attn = self.attn.forward(self.ln_1.forward(x.clone()));
        let x = x + self.dropout.forward(attn, at, 0);
        let mlp = self.mlp.forward(self.ln_2.forward(x.clone()));
        x + self.dropout.forward(mlp, at, 1)
    }
}

/// Positions `start..start + len` of every sequence of a `[b, s, h]` buffer.
fn seq_slice(v: &[f32], [b, s, h]: [usize; 3], start: usize, len: usize) -> Vec<f32> {
    (0..b)
        .flat_map(|i| v[(i * s + start) * h..(i * s + start + len) * h].to_vec())
        .collect()
}

/// Under sequence parallelism over `tp`, each rank's block takes and gives its slice of the
/// sequence (`[b, s / tp, h]`), with the one-rank block's values there; the input gradient is
/// the slice of the one-rank gradient, and the LayerNorm and output-bias gradients (computed
/// from a slice of the tokens) are the whole one-rank gradients; with the reduce-scatters
/// serial and cut into 2 chunks (`tp_overlap`).
pub fn sequence(tp: Group) {
    for chunks in [1, 2] {
        sequence_block(tp, TpOverlap::new(chunks).unwrap());
    }
}

fn sequence_block(tp: Group, overlap: TpOverlap) {
    let rng = InitRng::new(5);
    let (b, s, h, heads) = (2, 8, 8, 4);
    let dev = Default::default();
    let at = DropoutPosition {
        step: 3,
        first_sample: 0,
        forced: true,
    };
    let full = rng.normal("x", b * s * h, 1.0);
    let (start, len) = SeqShare::of(tp).range(s);
    let serial = Block::new(&rng, [s, h, heads], Group::local(), None);
    let par = Block::new(&rng, [s, h, heads], tp, Some(overlap));
    let xs =
        Tensor::<B, 3>::from_data(TensorData::new(full.clone(), [b, s, h]), &dev).require_grad();
    let part = seq_slice(&full, [b, s, h], start, len);
    let xp = Tensor::<B, 3>::from_data(TensorData::new(part, [b, len, h]), &dev).require_grad();
    let upstream = rng.normal("dy", b * s * h, 1.0);
    let ys = serial.forward(xs.clone(), &at);
    let yp = par.forward(xp.clone(), &at);
    assert_eq!(
        yp.dims(),
        [b, len, h],
        "the block's output is this rank's slice"
    );
    let ys_v = to_vec(ys.clone());
    let k = overlap.chunks();
    check(
        &format!("sequence-parallel block forward, {k} chunks"),
        to_vec(yp.clone()),
        seq_slice(&ys_v, [b, s, h], start, len),
    );
    let dy = |v: Vec<f32>, n| Tensor::<B, 3>::from_data(TensorData::new(v, [b, n, h]), &dev);
    let gs = (ys * dy(upstream.clone(), s)).sum().backward();
    let local_dy = seq_slice(&upstream, [b, s, h], start, len);
    let gp = (yp * dy(local_dy, len)).sum().backward();
    let gs_x = to_vec(xs.grad(&gs).unwrap());
    check(
        &format!("sequence-parallel input grad, {k} chunks"),
        to_vec(xp.grad(&gp).unwrap()),
        seq_slice(&gs_x, [b, s, h], start, len),
    );
    for (what, p, q) in [
        ("ln_1 gain", &par.ln_1.gamma, &serial.ln_1.gamma),
        ("ln_2 shift", &par.ln_2.beta, &serial.ln_2.beta),
    ] {
        check(
            what,
            to_vec(p.grad(&gp).unwrap()),
            to_vec(q.grad(&gs).unwrap()),
        );
    }
    let bias = |m: &Block| m.mlp.proj.bias.clone().unwrap();
    check(
        "mlp output bias grad",
        to_vec(bias(&par).grad(&gp).unwrap()),
        to_vec(bias(&serial).grad(&gs).unwrap()),
    );
}
