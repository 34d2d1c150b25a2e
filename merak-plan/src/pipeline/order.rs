//! A rank's compute order before the messages are added: what the schedule builders
//! (1F1B, interleaved, the zero-bubble orders) produce and the schedule turns into actions.

/// One compute action in a rank's compute order, before the messages are added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// Forward of (`mb`, `stage`).
    F(usize, usize),
    /// Backward of (`mb`, `stage`) (only its input gradient in a split backward).
    B(usize, usize),
    /// Weight gradients of (`mb`, `stage`) in a split backward.
    W(usize, usize),
    /// DualPipeV's overlapped pair: the forward of (`mb`, `stage`) and the backward (B) of
    /// another (`mb`, `stage`) on the same rank.
    Pair((usize, usize), (usize, usize)),
}
