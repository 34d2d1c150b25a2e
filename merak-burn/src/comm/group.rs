//! Handles to communicators that can live inside Burn modules and autodiff state.
//!
//! MPI communicators are not `Send`, while Burn requires module fields and backward-pass state
//! to be `Send`. A [`Group`] is a small `Send + Copy` handle to a communicator registered on the
//! current thread. Burn runs the backward pass on the thread that calls `backward()`, so the
//! handle always resolves where it is used.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use super::{CommError, Communicator};

/// The communicators of this thread by id, with the last id handed out.
type Registry = (u64, HashMap<u64, Rc<dyn Communicator>>);

thread_local! {
    static REGISTRY: RefCell<Registry> = RefCell::new((0, HashMap::new()));
}

/// A handle to a communicator registered on this thread, with its rank and size cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    id: u64,
    rank: usize,
    size: usize,
}

impl Group {
    /// Registers `comm` on this thread and returns its handle. The communicator lives as long
    /// as the thread does.
    pub fn register(comm: Rc<dyn Communicator>) -> Group {
        let (rank, size) = (comm.rank(), comm.size());
        REGISTRY.with(|r| {
            let mut r = r.borrow_mut();
            r.0 += 1;
            let id = r.0;
            r.1.insert(id, comm);
            Group { id, rank, size }
        })
    }

    /// A group of one rank (no communication), for example the TP group when tp = 1.
    pub fn local() -> Group {
        Group::register(Rc::new(super::LocalCommunicator))
    }

    /// Drops every communicator registered on this thread. Called before MPI is finalised
    /// (communicators must be freed while MPI is still running); handles made earlier stop
    /// resolving afterwards.
    pub fn release_all() {
        REGISTRY.with(|r| r.borrow_mut().1.clear());
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The communicator behind the handle.
    pub fn comm(&self) -> Result<Rc<dyn Communicator>, CommError> {
        REGISTRY.with(|r| {
            r.borrow()
                .1
                .get(&self.id)
                .cloned()
                .ok_or(CommError::UnknownGroup(self.id))
        })
    }
}
