//! The split backward ([`crate::kernels::deferred`]) with the data-parallel gradient hooks of
//! [`ParallelBackend::grad_hook`]: B then W delivers what the unsplit backward delivers.

use std::cell::RefCell;
use std::rc::Rc;

use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use crate::backend::{CpuAutodiff, CpuDevice};
use crate::kernels::deferred::{enable, open, pending, run};
use crate::tensor_parallel::{GradSink, ParallelBackend, set_grad_sink};

type B = CpuAutodiff;
type Deliveries = Vec<(usize, Vec<f32>)>;
type Delivered = Rc<RefCell<Deliveries>>;

fn tensor(rows: usize, cols: usize, seed: f32) -> Tensor<B, 2> {
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| (i as f32 * 0.37 + seed).sin() * 0.5)
        .collect();
    Tensor::from_data(TensorData::new(v, [rows, cols]), &CpuDevice::default()).require_grad()
}

/// One backward pass of `(x W + b) * g` with `W` behind gradient hook 7: the hooks'
/// deliveries and the input gradient. With `split`, B runs in an open backward and W after.
fn backward(split: bool) -> (Deliveries, Vec<f32>, usize) {
    enable(split);
    let got: Delivered = Rc::default();
    let sink = got.clone();
    set_grad_sink(Some(GradSink::host(move |hook, grad| {
        sink.borrow_mut().push((hook, grad))
    })));
    let (x, w) = (tensor(5, 4, 0.1), tensor(4, 3, 0.7));
    let hooked = B::grad_hook(w.into_primitive().tensor(), 7);
    let w = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(hooked));
    let b = Tensor::<B, 1>::from_data([0.1f32, -0.2, 0.3], &CpuDevice::default());
    let y = crate::kernels::linear(x.clone(), w, Some(b.require_grad()));
    let loss = (y * tensor(5, 3, 1.3)).sum();
    let grads = {
        let _open = split.then(|| open((0, 1)));
        loss.backward()
    };
    let dx = x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap();
    let before_w = got.borrow().len();
    run((0, 1));
    set_grad_sink(None);
    enable(false);
    let delivered = got.borrow().clone();
    (delivered, dx, before_w)
}

#[test]
fn b_then_w_is_the_unsplit_backward_bit_for_bit() {
    let (unsplit, dx, during) = backward(false);
    assert_eq!(
        during, 1,
        "the unsplit backward delivers the weight gradient itself"
    );
    let (split, dx_split, during_b) = backward(true);
    assert_eq!(during_b, 0, "B delivers no weight gradient");
    assert_eq!(split, unsplit, "W delivers what the unsplit backward did");
    assert_eq!(split[0].0, 7);
    assert_eq!(split[0].1.len(), 12);
    assert_eq!(dx_split, dx);
    assert_eq!(pending(), 0);
}
