//! A world of one process: every collective is the identity.

use super::{CommError, Communicator, Pending, ReduceOp, check_len, check_rank};

/// A communicator of exactly one rank. Used when `merak` runs without `mpirun`, and for
/// single-rank groups (tp=1, for example) so that they cost no communication at all.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalCommunicator;

struct Done(Vec<f32>);

impl Pending for Done {
    fn test(&mut self) -> Result<bool, CommError> {
        Ok(true)
    }
    fn wait(self: Box<Self>) -> Result<Vec<f32>, CommError> {
        Ok(self.0)
    }
}

impl Communicator for LocalCommunicator {
    fn split(
        &self,
        _color: usize,
        _key: usize,
    ) -> Result<std::rc::Rc<dyn Communicator>, CommError> {
        Ok(std::rc::Rc::new(LocalCommunicator))
    }

    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn kind(&self) -> &'static str {
        "local"
    }
    fn all_reduce(&self, _buf: &mut [f32], _op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        check_len("all_gather", send.len(), recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn reduce_scatter(
        &self,
        send: &[f32],
        recv: &mut [f32],
        _op: ReduceOp,
    ) -> Result<(), CommError> {
        check_len("reduce_scatter", recv.len(), send.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), CommError> {
        check_len("all_to_all", send.len(), recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn broadcast(&self, _buf: &mut [f32], root: usize) -> Result<(), CommError> {
        check_rank("broadcast", root, 1)
    }
    fn broadcast_bytes(&self, _buf: &mut [u8], root: usize) -> Result<(), CommError> {
        check_rank("broadcast", root, 1)
    }
    fn send(&self, _buf: &[f32], dest: usize, _tag: u16) -> Result<(), CommError> {
        // A message to oneself would need buffering until the matching receive; no
        // single-process code path sends to itself, so this is reported instead.
        Err(CommError::BadRank {
            op: "send (to self in a world of one)",
            rank: dest,
            size: 1,
        })
    }
    fn recv(&self, _buf: &mut [f32], src: usize, _tag: u16) -> Result<(), CommError> {
        Err(CommError::BadRank {
            op: "recv (from self in a world of one)",
            rank: src,
            size: 1,
        })
    }
    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
    fn all_reduce_start(
        &self,
        buf: Vec<f32>,
        _op: ReduceOp,
    ) -> Result<Box<dyn Pending>, CommError> {
        Ok(Box::new(Done(buf)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_broadcast_whole_or_cut_at_the_limit() {
        let c = LocalCommunicator;
        assert_eq!(
            c.broadcast_text("20261125-194530", 64, 0).unwrap(),
            "20261125-194530"
        );
        assert_eq!(c.broadcast_text("", 64, 0).unwrap(), "");
        assert_eq!(c.broadcast_text("abcdef", 4, 0).unwrap(), "abcd");
    }

    /// The default non-blocking reduce-scatter and all-gather (run at once) on one rank.
    #[test]
    fn non_blocking_reduce_scatter_and_all_gather_of_one_rank_return_the_input() {
        let c = LocalCommunicator;
        let rs = c
            .reduce_scatter_start(vec![1.0, 2.0], ReduceOp::Mean)
            .unwrap();
        assert_eq!(rs.wait().unwrap(), vec![1.0, 2.0]);
        let ag = c.all_gather_start(vec![3.0]).unwrap();
        assert_eq!(ag.wait().unwrap(), vec![3.0]);
    }
}
