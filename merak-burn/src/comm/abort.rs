//! Ending a job that cannot go on: one-line reports on stderr that ranks sharing the
//! launcher's output do not interleave, and `MPI_Abort`.

/// Writes `line` to stderr as one line in one write, so that the lines of ranks sharing the
/// launcher's stderr do not interleave (a message's newlines become `; `).
pub fn report_line(line: &str) {
    use std::io::Write;
    let mut one = line.trim_end().replace('\n', "; ");
    one.push('\n');
    let _ = std::io::stderr().lock().write_all(one.as_bytes());
}

/// Calls `MPI_Abort` on the world communicator.
pub(crate) fn abort_world(code: i32) -> ! {
    // SAFETY: MPI is initialised (an `MpiWorld` exists) and MPI_Abort does not return.
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
    }
    std::process::exit(code)
}
