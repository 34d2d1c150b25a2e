//! [`FusedOps`] on burn-flex: the [`cpu`](super::cpu) kernels on the tensors' own buffers.
//! Tensors of another element type than `f32` take the composed defaults.

use burn::tensor::{DType, TensorData, TensorMetadata};
use burn_flex::{Flex, FlexTensor};

use super::cpu::gemm::View;
use super::cpu::xent::{self, Columns};
use super::cpu::{adamw, blockwise, embedding, gelu, linear, math, norm};
use super::{AdamWStep, AttentionSpec, FusedOps, NormStats, Squares, VocabShard, composed, fatal};
use crate::comm::{Group, ReduceOp};

/// The tensor's values as a contiguous `f32` tensor (a view when it already is one).
fn contiguous(t: &FlexTensor) -> FlexTensor {
    t.to_contiguous()
}

/// A new tensor holding `values` with `shape`.
fn tensor<const D: usize>(values: Vec<f32>, shape: [usize; D]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The values of an integer tensor, widened to `i64`.
fn int_values(t: &FlexTensor) -> Vec<i64> {
    let t = t.to_contiguous();
    match t.dtype() {
        DType::I64 => t.storage::<i64>().to_vec(),
        DType::I32 => t.storage::<i32>().iter().map(|&x| i64::from(x)).collect(),
        DType::I16 => t.storage::<i16>().iter().map(|&x| i64::from(x)).collect(),
        DType::U32 => t.storage::<u32>().iter().map(|&x| i64::from(x)).collect(),
        other => panic!("fused kernels: integer tensors of {other:?} are not supported"),
    }
}

fn is_f32(t: &FlexTensor) -> bool {
    t.dtype() == DType::F32
}

/// `[rows, cols]` of a rank-2 tensor.
fn dims2(t: &FlexTensor) -> [usize; 2] {
    let s = t.shape();
    [s[0], s[1]]
}

/// A rank-2 tensor as a strided view of its buffer (copied first if a stride is negative).
fn matrix(t: &FlexTensor) -> (FlexTensor, View) {
    let view = |t: &FlexTensor| {
        let l = t.layout();
        let (s, st) = (l.shape(), l.strides());
        (st[0] >= 0 && st[1] >= 0)
            .then(|| View::new(l.start_offset(), s[0], s[1], st[0] as usize, st[1] as usize))
    };
    match view(t) {
        Some(v) => (t.clone(), v),
        None => {
            let c = t.to_contiguous();
            let v = view(&c).expect("a contiguous tensor has non-negative strides");
            (c, v)
        }
    }
}

/// The last dimension and the number of rows before it.
fn rows_of(t: &FlexTensor) -> (usize, usize) {
    let s = t.shape();
    let d = s[s.num_dims() - 1].max(1);
    (s.num_elements() / d, d)
}

/// A new tensor with `values` and the shape of `like`.
fn tensor_like(values: Vec<f32>, like: &FlexTensor) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, like.shape()))
}

fn all_reduce(group: Group, buf: &mut [f32], op: ReduceOp) {
    let what = "cross-entropy all-reduce";
    let comm = group.comm().unwrap_or_else(|e| fatal(what, e));
    comm.all_reduce(buf, op).unwrap_or_else(|e| fatal(what, e));
}

/// The tensor, contiguous, for writing through `storage_mut`: that writes in place when this is
/// the only reference to the data and copies it first otherwise.
fn owned(t: FlexTensor) -> FlexTensor {
    t.to_contiguous()
}

impl FusedOps for Flex {
    fn gather_forward(table: FlexTensor, ids: FlexTensor, start: usize) -> FlexTensor {
        if !is_f32(&table) {
            return composed::gather_forward::<Flex>(table, ids, start);
        }
        let table = contiguous(&table);
        let [rows, d] = dims2(&table);
        let ids = int_values(&ids);
        let out = embedding::gather(table.storage::<f32>(), rows, d, &ids, start);
        tensor(out, [ids.len(), d])
    }

    fn gather_backward(ids: FlexTensor, dy: FlexTensor, rows: usize, start: usize) -> FlexTensor {
        if !is_f32(&dy) {
            return composed::gather_backward::<Flex>(ids, dy, rows, start);
        }
        let dy = contiguous(&dy);
        let [_, d] = dims2(&dy);
        let ids = int_values(&ids);
        let mut grad = vec![0.0; rows * d];
        embedding::scatter_add(dy.storage::<f32>(), d, &ids, start, &mut grad);
        tensor(grad, [rows, d])
    }

    fn into_host_vec(x: FlexTensor) -> Vec<f32> {
        if !is_f32(&x) {
            return composed::to_host::<Flex>(x);
        }
        // Zero-copy when `x` is the only, contiguous reference to a buffer allocated for f32s.
        x.into_data().into_vec::<f32>().unwrap_or_default()
    }

    fn adamw_step(
        param: FlexTensor,
        grad: FlexTensor,
        moments: Option<(FlexTensor, FlexTensor)>,
        step: AdamWStep,
    ) -> (FlexTensor, FlexTensor, FlexTensor) {
        if !is_f32(&param) || !is_f32(&grad) {
            return composed::adamw_step::<Flex>(param, grad, moments, step);
        }
        let grad = contiguous(&grad);
        let n = grad.shape().num_elements();
        let (mut m, mut v) = match moments {
            Some((m, v)) => (owned(m), owned(v)),
            None => (
                tensor_like(vec![0.0; n], &param),
                tensor_like(vec![0.0; n], &param),
            ),
        };
        let mut p = owned(param);
        adamw::step_in_place(
            p.storage_mut::<f32>(),
            grad.storage::<f32>(),
            m.storage_mut::<f32>(),
            v.storage_mut::<f32>(),
            step,
        );
        (p, m, v)
    }

    fn sum_of_squares(x: FlexTensor) -> f64 {
        if !is_f32(&x) {
            return composed::sum_of_squares::<Flex>(x);
        }
        let x = contiguous(&x);
        let values = x.storage::<f32>();
        math::simd(
            #[inline(always)]
            || math::sum_of_squares(values),
        )
    }

    fn squares_of(xs: Vec<FlexTensor>) -> Squares<Self> {
        Squares::Host(xs.into_iter().map(Self::sum_of_squares).collect())
    }

    fn cross_entropy_forward(
        logits: FlexTensor,
        targets: FlexTensor,
        shard: VocabShard,
        group: Group,
    ) -> (FlexTensor, FlexTensor) {
        if !is_f32(&logits) {
            return composed::cross_entropy_forward::<Flex>(logits, targets, shard, group);
        }
        let logits = contiguous(&logits);
        let [rows, cols] = dims2(&logits);
        let targets = int_values(&targets);
        let columns = Columns {
            cols,
            start: shard.start as i64,
            valid: shard.valid.min(cols),
        };
        let mut st = xent::row_stats(logits.storage::<f32>(), &targets, columns);
        let mut max = st.max.clone();
        if group.size() > 1 {
            all_reduce(group, &mut max, ReduceOp::Max);
            xent::rescale_to_global_max(&mut st.sum_exp, &st.max, &max);
            let mut sums = [st.sum_exp, st.target].concat();
            all_reduce(group, &mut sums, ReduceOp::Sum);
            st.target = sums.split_off(rows);
            st.sum_exp = sums;
        }
        let (stats, loss) = xent::combine(&max, &st.sum_exp, &st.target, &targets);
        (tensor(vec![loss], [1]), tensor(stats, [rows, 2]))
    }

    fn cross_entropy_backward(
        logits: FlexTensor,
        stats: FlexTensor,
        targets: FlexTensor,
        shard: VocabShard,
        grad: FlexTensor,
    ) -> FlexTensor {
        if !is_f32(&logits) {
            return composed::cross_entropy_backward::<Flex>(logits, stats, targets, shard, grad);
        }
        // The logits are not needed after this: when this is their only reference, the
        // gradient is written over them.
        let mut out = contiguous(&logits);
        drop(logits);
        let [_, cols] = dims2(&out);
        let columns = Columns {
            cols,
            start: shard.start as i64,
            valid: shard.valid.min(cols),
        };
        let g = contiguous(&grad).storage::<f32>()[0];
        let stats = contiguous(&stats);
        let targets = int_values(&targets);
        xent::backward_in_place(
            out.storage_mut::<f32>(),
            stats.storage::<f32>(),
            &targets,
            columns,
            g,
        );
        out
    }

    fn linear_forward(x: FlexTensor, w: FlexTensor, bias: Option<FlexTensor>) -> FlexTensor {
        if !is_f32(&x) || !is_f32(&w) {
            return composed::linear_forward::<Flex>(x, w, bias);
        }
        let ((x, xv), (w, wv)) = (matrix(&x), matrix(&w));
        let bias = bias.map(|b| contiguous(&b));
        let y = linear::forward(
            x.storage::<f32>(),
            xv,
            w.storage::<f32>(),
            wv,
            bias.as_ref().map(|b| b.storage::<f32>()),
        );
        tensor(y, [xv.rows, wv.cols])
    }

    fn linear_backward(
        x: Option<FlexTensor>,
        w: FlexTensor,
        dy: FlexTensor,
        want: [bool; 3],
    ) -> [Option<FlexTensor>; 3] {
        if !is_f32(&dy) {
            return composed::linear_backward::<Flex>(x, w, dy, want);
        }
        let dy = contiguous(&dy);
        let [rows, d_out] = dims2(&dy);
        let g = dy.storage::<f32>();
        let (w, wv) = matrix(&w);
        let dx = want[0].then(|| {
            let dx = linear::grad_input(g, w.storage::<f32>(), wv);
            tensor(dx, [rows, wv.rows])
        });
        let dw = x.filter(|_| want[1]).map(|x| {
            let (x, xv) = matrix(&x);
            let d_in = xv.cols;
            // Written column-major ([d_out, d_in] transposed) when the weight is such a view
            // (a tied head), so that its gradient adds to the table's without a copy.
            let transposed = wv.rs == 1 && wv.cs == d_in && d_out > 1;
            let dw = linear::grad_weight(x.storage::<f32>(), xv, g, d_out, transposed);
            if transposed {
                tensor(dw, [d_out, d_in]).transpose(0, 1)
            } else {
                tensor(dw, [d_in, d_out])
            }
        });
        let db = want[2].then(|| {
            let mut db = vec![0.0; d_out];
            linear::grad_bias(g, &mut db);
            tensor(db, [d_out])
        });
        [dx, dw, db]
    }

    fn layer_norm_forward(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        eps: f64,
    ) -> (FlexTensor, NormStats<Flex>) {
        if !is_f32(&x) {
            return composed::layer_norm_forward::<Flex>(x, gamma, beta, eps);
        }
        let (x, gamma, beta) = (contiguous(&x), contiguous(&gamma), contiguous(&beta));
        let (rows, _) = rows_of(&x);
        let mut y = vec![0.0; x.shape().num_elements()];
        let (mean, rstd) = norm::forward(
            x.storage::<f32>(),
            gamma.storage::<f32>(),
            Some(beta.storage::<f32>()),
            eps as f32,
            &mut y,
        );
        (
            tensor_like(y, &x),
            (tensor(mean, [rows]), tensor(rstd, [rows])),
        )
    }

    fn layer_norm_backward(
        x: FlexTensor,
        gamma: FlexTensor,
        stats: NormStats<Flex>,
        dy: FlexTensor,
    ) -> [FlexTensor; 3] {
        if !is_f32(&x) {
            return composed::layer_norm_backward::<Flex>(x, gamma, stats, dy);
        }
        let (x, gamma) = (contiguous(&x), contiguous(&gamma));
        let (mean, rstd) = (contiguous(&stats.0), contiguous(&stats.1));
        let d = gamma.shape().num_elements();
        let mut dx = contiguous(&dy);
        drop(dy);
        let (mut dgamma, mut dbeta) = (vec![0.0; d], vec![0.0; d]);
        norm::backward_in_place(
            x.storage::<f32>(),
            gamma.storage::<f32>(),
            mean.storage::<f32>(),
            rstd.storage::<f32>(),
            dx.storage_mut::<f32>(),
            &mut dgamma,
            &mut dbeta,
        );
        [dx, tensor(dgamma, [d]), tensor(dbeta, [d])]
    }

    fn bias_gelu_forward(x: FlexTensor, bias: FlexTensor) -> FlexTensor {
        if !is_f32(&x) {
            return composed::bias_gelu_forward::<Flex>(x, bias);
        }
        let (x, bias) = (contiguous(&x), contiguous(&bias));
        let mut y = vec![0.0; x.shape().num_elements()];
        gelu::forward(x.storage::<f32>(), bias.storage::<f32>(), &mut y);
        tensor_like(y, &x)
    }

    fn bias_gelu_backward(x: FlexTensor, bias: FlexTensor, dy: FlexTensor) -> [FlexTensor; 2] {
        if !is_f32(&x) {
            return composed::bias_gelu_backward::<Flex>(x, bias, dy);
        }
        let (x, bias) = (contiguous(&x), contiguous(&bias));
        let d = bias.shape().num_elements();
        let mut dx = contiguous(&dy);
        drop(dy);
        let mut dbias = vec![0.0; d];
        gelu::backward_in_place(
            x.storage::<f32>(),
            bias.storage::<f32>(),
            dx.storage_mut::<f32>(),
            &mut dbias,
        );
        [dx, tensor(dbias, [d])]
    }

    fn attention_forward(
        qkv: FlexTensor,
        spec: AttentionSpec,
        segments: Option<FlexTensor>,
    ) -> (FlexTensor, Option<FlexTensor>) {
        if !is_f32(&qkv) {
            return composed::attention_forward::<Flex>(qkv, spec, segments);
        }
        let qkv = contiguous(&qkv);
        let shape = attention_shape(&qkv, spec);
        let segments = segments.as_ref().map(int_values);
        let mut ctx = vec![0.0; shape.ctx_len()];
        let mut lse = vec![0.0; shape.lse_len()];
        let mask = self_mask(spec, segments.as_deref());
        blockwise::forward(qkv.storage::<f32>(), shape, mask, &mut ctx, &mut lse);
        let (b, s, h, d) = (shape.batch, shape.seq, shape.heads, shape.head_dim);
        (tensor(ctx, [b, s, h * d]), Some(tensor(lse, [b, h, s])))
    }

    fn attention_backward(
        qkv: FlexTensor,
        ctx: FlexTensor,
        lse: Option<FlexTensor>,
        dctx: FlexTensor,
        spec: AttentionSpec,
        segments: Option<FlexTensor>,
    ) -> FlexTensor {
        let lse = match lse {
            Some(lse) if is_f32(&qkv) => lse,
            lse => {
                return composed::attention_backward::<Flex>(qkv, ctx, lse, dctx, spec, segments);
            }
        };
        let [qkv, ctx, lse, dctx] = [qkv, ctx, lse, dctx].map(|t| contiguous(&t));
        let shape = attention_shape(&qkv, spec);
        let segments = segments.as_ref().map(int_values);
        let mut dqkv = vec![0.0; shape.qkv_len()];
        blockwise::backward(
            qkv.storage::<f32>(),
            ctx.storage::<f32>(),
            lse.storage::<f32>(),
            dctx.storage::<f32>(),
            shape,
            self_mask(spec, segments.as_deref()),
            &mut dqkv,
        );
        tensor_like(dqkv, &qkv)
    }
}

/// The kernel's mask: causal or not, positions `0..seq`, the segment ids if any.
fn self_mask(spec: AttentionSpec, segments: Option<&[i64]>) -> blockwise::SelfMask<'_> {
    blockwise::SelfMask {
        causal: spec.causal,
        positions: blockwise::Positions::From(0),
        segments,
    }
}

/// The kernel's shape of a `[batch, seq, 3 * heads * head_dim]` buffer.
fn attention_shape(qkv: &FlexTensor, spec: AttentionSpec) -> blockwise::Shape {
    let s = qkv.shape();
    blockwise::Shape {
        batch: s[0],
        seq: s[1],
        heads: spec.heads,
        head_dim: s[2] / 3 / spec.heads.max(1),
    }
}
